"""Token files on disk: the formats (described here only), writing meta.json, and checking and
reading a split. A split is one file or a set of shards, read as one token space.

  <data_dir>/train.bin, <data_dir>/val.bin
      Raw little-endian token ids, no header: uint16 when the vocabulary fits in 65,536 ids,
      else uint32. Every document is followed by the tokenizer's end-of-text id. Files made by
      nanoGPT's prepare.py are the same format (uint16).
  <data_dir>/meta.json, written last
      {"format_version": 1, "dtype": "uint16", "vocab_size": 50257, "tokenizer": "gpt2",
       "eot_token": 50256,
       "splits": {"train": {"tokens": N, "documents": D, "fingerprint": "..."}, "val": {...}},
       ... and how the files were made (prepare.py adds its source and settings)}
      "fingerprint" is sampled_fingerprint() of the split: its files' sizes and 64 evenly
      spaced 4 KiB chunks of its tokens, so checking it costs the same for 16 MiB as for 16 GiB,
      and for one file as for 10,000 shards.
  <data_dir>/train_000000.bin, train_000001.bin, ..., val_000000.bin, ... (prepare.py
      --shard_tokens): shards in the same raw format; meta.json then lists them per split,
      "shards": [{"file": "train_000000.bin", "tokens": n, "fingerprint": "..."}, ...], in the
      order they are read. With "format": "llmc" each shard has llm.c's header (below).
  <data_dir>/*_train_*.bin, *_val_*.bin, no meta.json: llm.c / modded-nanogpt shards (e.g.
      fineweb_val_000000.bin, fineweb_train_000001.bin), read as they are, in name order:
      a header of 256 little-endian int32 (magic 20240520, version 1, the token count, zeros),
      then the tokens as uint16 GPT-2 ids.
  <data_dir>/meta.pkl, no meta.json: nanoGPT's character-level data (shakespeare_char), a
      pickle of {"vocab_size": 65, "stoi": {char: id}, "itos": {id: char}} beside uint16
      train.bin and val.bin. read_meta gives it as a meta dict with tokenizer "char" and the
      table (stoi, and itos as a list), so that training has its vocabulary and sampling its
      characters. Only plain data is unpickled: a pickle that names any class or function,
      which loading would import and call, is refused.
  A folder with .bin files and no meta.json is read as nanoGPT's raw uint16.
  <data_dir>/train.docidx, val.docidx: a split's document index (docindex.py describes it).
  While prepare.py writes a folder it also holds ddpgpt.lock (lock.py), temporary files
  <name>.<pid>@<host>.tmp (fileio.tmp_path) and, for shards, prepare.progress.json.

A TokenSplit holds paths, a dtype and where each file starts in the split's token space, never an
open file: it pickles small and works in any process, forked or spawned. Each read opens the files
it needs and reads each window with one os.pread, so no page read stays in the resident memory of a
long run, and a random window costs one small read (a memmap faults in the disk's read-ahead around
each window; docs/benchmarks.md measures both). A window never crosses from one file into the next:
data.py draws it inside one, and one that meets its file's end (sampling='documents') is cut there.
"""
import gc
import glob
import hashlib
import json
import logging
import os
import pickle
import re
from typing import Any, NamedTuple

import numpy as np

from ddpgpt import fileio
from ddpgpt.errors import UserError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
META_NAME = "meta.json"
NANOGPT_META = "meta.pkl"
PROGRESS_NAME = "prepare.progress.json"  # prepare.py's, while a sharded run is not complete
SPLITS = ("train", "val")
FINGERPRINT_CHUNKS, FINGERPRINT_CHUNK_BYTES = 64, 4096
# the corpus is the user's to name: left out, prepare.py downloads OpenWebText (13 GB)
PREPARE_HINT = "python prepare.py --dataset=<corpus> --out_dir={}"
LLMC_MAGIC, LLMC_VERSION, LLMC_HEADER_BYTES = 20240520, 1, 256 * 4
# GPT-2's tokenizer: 256 bytes, 50,000 merges and end-of-text, the last id; the tokens of
# nanoGPT's raw files and llm.c's shards, which come without a meta.json to say so
GPT2_VOCAB_SIZE, GPT2_EOT = 50257, 50256
LLMC_META = {"format_version": FORMAT_VERSION, "format": "llmc", "dtype": "uint16",
             "vocab_size": GPT2_VOCAB_SIZE, "tokenizer": "gpt2", "eot_token": GPT2_EOT,
             "splits": {}, "source": f"llm.c shards (magic {LLMC_MAGIC}, version {LLMC_VERSION})"}


class TokenSplit(NamedTuple):
    """One split's files, read as one token space: file k holds tokens [starts[k], starts[k+1])
    of it, after a header of header_bytes; its sampled_fingerprint, and its document index
    where it was opened with one."""
    paths: tuple
    dtype: np.dtype
    header_bytes: int
    starts: np.ndarray
    fingerprint: str = ""
    docs: Any = None  # its docindex.DocIndex, where sources.open_split opened it

    @property
    def n_tokens(self):
        return int(self.starts[-1])


def token_dtype(vocab_size):
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def sampled_fingerprint(paths, header_bytes=0, sizes=None):
    """A hash of the files' sizes and of 64 evenly spaced 4 KiB chunks of their data bytes,
    taken as one run of bytes (a chunk that meets the end of a file stops there). sizes: the
    data bytes of each file, when the caller has read them already (10,000 stats cost)."""
    if sizes is None:
        sizes = [os.path.getsize(p) - header_bytes for p in paths]
    starts = np.cumsum([0, *sizes])
    h = hashlib.blake2b(",".join(map(str, sizes)).encode(), digest_size=16)
    chunk = min(FINGERPRINT_CHUNK_BYTES, int(starts[-1]))
    for i in range(FINGERPRINT_CHUNKS):
        at = (int(starts[-1]) - chunk) * i // (FINGERPRINT_CHUNKS - 1)
        k = min(int(np.searchsorted(starts, at, side="right")) - 1, len(paths) - 1)
        with open(paths[k], "rb") as f:
            f.seek(header_bytes + at - int(starts[k]))
            h.update(f.read(chunk))
    return h.hexdigest()


# ---- writing: prepare.py streams into .tmp files; these describe and publish the result ----

def describe_split(path, dtype, documents):
    """meta.json's entry for a complete token file."""
    return {"tokens": os.path.getsize(path) // np.dtype(dtype).itemsize, "documents": documents,
            "fingerprint": sampled_fingerprint([path])}


def write_meta(data_dir, *, tokenizer, vocab_size, eot_token, splits, **provenance):
    """The one writer of meta.json; splits is {split: describe_split(...)}."""
    fileio.write_json(os.path.join(data_dir, META_NAME), {
        "format_version": FORMAT_VERSION, "dtype": token_dtype(vocab_size).name,
        "vocab_size": vocab_size, "tokenizer": tokenizer, "eot_token": eot_token,
        "splits": splits, **provenance})


# ---- reading ----

def llmc_shards(data_dir, split):
    return sorted(glob.glob(os.path.join(glob.escape(data_dir), f"*_{split}_*.bin")))


def meta_path(data_dir):
    """The file read_meta reads: meta.json, or nanoGPT's meta.pkl where it is alone."""
    path = os.path.join(data_dir, META_NAME)
    pickled = os.path.join(data_dir, NANOGPT_META)
    return pickled if not os.path.exists(path) and os.path.exists(pickled) else path


def read_meta(data_dir):
    """meta.json as a dict; for nanoGPT's meta.pkl or llm.c shards without one, what they
    imply; None for a nanoGPT-style folder of raw .bin files."""
    path = meta_path(data_dir)
    if path.endswith(NANOGPT_META):
        return char_meta(path)
    if not os.path.exists(path):
        has_llmc = not os.path.exists(os.path.join(data_dir, "train.bin")) and \
            any(llmc_shards(data_dir, split) for split in SPLITS)
        return dict(LLMC_META) if has_llmc else None
    hint = PREPARE_HINT.format(data_dir)
    # gc paused for the parse: a meta.json of 10,000 shards is 10,000 dicts, whose allocation
    # sets off collections that walk every object torch made at import (0.17 s of a 0.19 s parse)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with open(path) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        problem = f"{type(e).__name__}: {e}"
    else:
        missing = [k for k in ("dtype", "splits", "vocab_size")
                   if not isinstance(meta, dict) or k not in meta]
        problem = f"it has no {', '.join(missing)}" if missing else None
    finally:
        if gc_was_enabled:
            gc.enable()
    if problem:
        raise UserError(f"{path} is not a valid ddpgpt meta.json ({problem}). It is written "
                        f"last by prepare.py, so a damaged one means the folder is "
                        f"incomplete: run `{hint}` again.")
    if meta.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{path} has format_version {meta.get('format_version')!r}, this code "
                        f"reads {FORMAT_VERSION}: run `{hint}` again.")
    return meta


class CodeInPickle(pickle.UnpicklingError):
    pass


class PlainData(pickle.Unpickler):
    """Unpickles plain data only: no global (a class or function it would call) is looked up."""

    def find_class(self, module, name):
        raise CodeInPickle(f"{module}.{name}")


def char_meta(path):
    """nanoGPT's meta.pkl of character-level data as a meta dict, read without running code."""
    remake = "make it again with nanoGPT's data/shakespeare_char/prepare.py"
    try:
        with open(path, "rb") as f:
            table = PlainData(f).load()
    except CodeInPickle as e:
        raise UserError(f"{path} was refused: loading it would execute code (it calls {e}), and "
                        f"a data folder's meta.pkl holds only plain data. Remove it, or "
                        f"{remake}.") from None
    except Exception as e:  # a damaged pickle fails in many ways (EOFError, KeyError, ...)
        raise UserError(f"{path} is not a readable pickle ({type(e).__name__}: {e}): "
                        f"{remake}.") from None
    table = table if isinstance(table, dict) else {}
    vocab, stoi, itos = table.get("vocab_size"), table.get("stoi"), table.get("itos")
    vocab_ok = isinstance(vocab, int) and 0 < vocab <= 2**16
    if vocab_ok and isinstance(itos, dict) and len(itos) == vocab:  # nanoGPT's is {id: char}
        itos = [itos.get(i) for i in range(vocab)]
    if not (vocab_ok and isinstance(itos, list) and len(itos) == vocab
            and all(isinstance(c, str) and len(c) == 1 for c in itos)
            and stoi == {c: i for i, c in enumerate(itos)}):
        raise UserError(f"{path} is not nanoGPT's character-level meta.pkl: it must be a dict "
                        f"of vocab_size (an int up to 65536), itos (each id below it -> its "
                        f"character) and stoi (character -> id, the inverse): {remake}.")
    return {"format_version": FORMAT_VERSION, "dtype": "uint16", "vocab_size": vocab,
            "tokenizer": "char", "stoi": stoi, "itos": itos, "splits": {},
            "source": f"{path} (nanoGPT's character-level data)"}


def split_files(data_dir, split, meta):
    """(paths, header bytes, the token count meta.json gives each file or None) of a split:
    the shards meta.json lists, else <split>.bin, else llm.c's *_<split>_*.bin."""
    info = (meta or {}).get("splits", {}).get(split, {})
    header = LLMC_HEADER_BYTES if (meta or {}).get("format") == "llmc" else 0
    if "shards" in info:
        folder = os.path.join(data_dir, "")  # a join per shard costs more than the stat
        return ([folder + s["file"] for s in info["shards"]], header,
                [s["tokens"] for s in info["shards"]])
    single = os.path.join(data_dir, f"{split}.bin")
    if os.path.isfile(single) or meta is None or meta.get("format") != "llmc":
        if not os.path.isfile(single):
            raise UserError(missing_split(data_dir, split, meta))
        return [single], 0, [info["tokens"]] if "tokens" in info else None
    shards = llmc_shards(data_dir, split)
    if not shards:
        raise UserError(f"{data_dir} holds llm.c shards but none of the {split} split "
                        f"(*_{split}_*.bin): llm.c's data scripts write the validation split as "
                        f"the first shard, e.g. fineweb_val_000000.bin; copy it there, or make the "
                        f"data with `{PREPARE_HINT.format(data_dir)} --format=llmc`.")
    return shards, LLMC_HEADER_BYTES, None


def missing_split(data_dir, split, meta):
    """Why <split>.bin is not there, as far as the folder tells: an unfinished prepare, shards
    without their meta.json, llm.c shards beside a stray train.bin, or nothing at all."""
    hint = PREPARE_HINT.format(data_dir)
    ours = sorted(glob.glob(os.path.join(glob.escape(data_dir), f"{split}_[0-9]*.bin")))
    llmc = [p for s in SPLITS for p in llmc_shards(data_dir, s)]
    if meta is None and os.path.exists(os.path.join(data_dir, PROGRESS_NAME)):
        return (f"{data_dir} holds an unfinished prepare: {PROGRESS_NAME} and the shards it "
                f"has published so far, but no {META_NAME}, which prepare.py writes last. Run "
                f"the prepare.py command that wrote it again: it resumes after those shards, "
                f"and train.py reads the folder once it has finished.")
    if meta is None and ours:
        return (f"{data_dir} holds shards ({os.path.basename(ours[0])} and {len(ours) - 1} more) "
                f"but no {META_NAME}, which lists each split's shards in order with their token "
                f"counts and dtype: it was deleted, or the folder was copied without it. Put it "
                f"back, or make the data again with `{hint} --shard_tokens=N`.")
    if meta is None and llmc:
        stray = [n for n in ("train.bin", "val.bin") if os.path.isfile(os.path.join(data_dir, n))]
        return (f"{data_dir} holds llm.c shards ({os.path.basename(llmc[0])} and "
                f"{len(llmc) - 1} more) and a stray {' and '.join(stray)}, but no {split}.bin: "
                f"a folder with train.bin or val.bin is read as nanoGPT's train.bin and val.bin. "
                f"Move {' and '.join(stray)} out of it to train on the llm.c shards, or the "
                f"shards out to train on nanoGPT's files.")
    return (f"{os.path.join(data_dir, split + '.bin')} does not exist (nor does {data_dir} hold "
            f"{split} shards): make the token files with `{hint}` (the corpus: a file, a "
            f"folder or a hub dataset; left out, it is OpenWebText, a 13 GB download), or set "
            f"data_dir to a folder that holds train.bin and val.bin, or llm.c shards "
            f"*_train_*.bin and *_val_*.bin.")


def check_llmc_shards(data_dir, split, paths):
    """llm.c shards of one dataset only (two would be read as one split, in name order), and
    a notice where their numbering has gaps (a download that left some out?)."""
    names = sorted({os.path.basename(p).rsplit(f"_{s}_", 1)[0]  # <name>_<split>_<index>.bin
                    for s in SPLITS for p in llmc_shards(data_dir, s)})
    if len(names) > 1:
        raise UserError(f"{data_dir} holds llm.c shards of {len(names)} datasets "
                        f"({', '.join(n + '_*' for n in names)}), which would be read as one "
                        f"{split} split: keep one dataset per folder, and train on several with "
                        f"data_mix='<folder>=<weight>,...'.")
    numbers = sorted(int(m.group(1)) for p in paths
                     if (m := re.search(r"_(\d+)\.bin$", os.path.basename(p))))
    missing = sorted(set(range(numbers[0], numbers[-1] + 1)) - set(numbers)) if numbers else []
    if missing:
        shown = ", ".join(f"{i:06d}" for i in missing[:5]) + (", ..." if len(missing) > 5 else "")
        log.info(f"data: note: the llm.c {split} shards in {data_dir} skip {len(missing)} "
                 f"number(s) ({shown}): read as they are, in name order. A download that left "
                 f"some out?")


def check_llmc_header(path, n_tokens):
    """llm.c's header must say what the file is: the magic, the version, the token count."""
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(LLMC_HEADER_BYTES), dtype="<i4")
    if len(header) < 3 or header[0] != LLMC_MAGIC or header[1] != LLMC_VERSION:
        found = f"magic {header[0]}, version {header[1]}" if len(header) >= 3 else \
            "a file shorter than the header"
        raise UserError(f"{path} is not an llm.c GPT-2 token shard: its header has {found}, not "
                        f"magic {LLMC_MAGIC}, version {LLMC_VERSION} (uint16 GPT-2 tokens; other "
                        f"llm.c formats, such as llama-3's uint32 shards, are not read). Remove it "
                        f"from the folder, or make the shards again.")
    if header[2] != n_tokens:
        raise UserError(f"{path}: its header says {header[2]} tokens but the file holds {n_tokens} "
                        f"after the {LLMC_HEADER_BYTES}-byte header: the shard is truncated or was "
                        f"not written completely. Download or make it again.")


def file_tokens(paths, dtype, header_bytes, listed, hint):
    """The number of tokens in each file, checked against its size, header and meta.json: a
    stat per file and the checks on all of them at once, so that 10,000 shards cost little
    more than one file."""
    try:
        sizes = np.array([os.stat(p).st_size for p in paths], dtype=np.int64) - header_bytes
    except FileNotFoundError as e:  # split_files checked a single file: a shard meta.json lists
        raise UserError(f"{e.filename} is listed in {META_NAME} but does not exist: it was "
                        f"deleted or moved after prepare.py wrote the folder. Restore it, or run "
                        f"`{hint}` again.") from None
    for k in np.flatnonzero((sizes < 0) | (sizes % dtype.itemsize != 0))[:1].tolist():
        raise UserError(f"{paths[k]} is {sizes[k] + header_bytes} bytes, which is not "
                        f"{'a header and ' if header_bytes else ''}a whole number of {dtype.name} "
                        f"tokens ({dtype.itemsize} bytes each): the file is truncated or is not a "
                        f"token file. Run `{hint}` again.")
    counts = sizes // dtype.itemsize
    if listed is not None:
        for k in np.flatnonzero(counts != np.asarray(listed, dtype=np.int64))[:1].tolist():
            raise UserError(f"{paths[k]} holds {counts[k]} tokens but {META_NAME} says "
                            f"{listed[k]}: the file was truncated, extended or replaced after "
                            f"prepare.py wrote it. Run `{hint}` again.")
    if header_bytes:
        for path, n_tokens in zip(paths, counts.tolist()):
            check_llmc_header(path, n_tokens)
    return counts


def open_split(data_dir, split, block_size):
    """Check one split on disk (against meta.json where there is one; file_tokens and the
    fingerprint) and return its TokenSplit, without its document index (sources.open_split)."""
    meta = read_meta(data_dir)
    hint = PREPARE_HINT.format(data_dir)
    paths, header, listed = split_files(data_dir, split, meta)
    if meta is None:
        log.info(f"data: {data_dir} has no {META_NAME}; reading {split}.bin as raw uint16 tokens "
                 "(nanoGPT's format)")
    elif meta.get("tokenizer") == "char":
        log.info(f"data: {data_dir} has nanoGPT's {NANOGPT_META}: {meta['vocab_size']} characters; "
                 f"reading {split}.bin as uint16")
    elif meta.get("format") == "llmc" and listed is None:
        check_llmc_shards(data_dir, split, paths)
    dtype = np.dtype(meta["dtype"] if meta else np.uint16)
    counts = file_tokens(paths, dtype, header, listed, hint)
    fingerprint = sampled_fingerprint(paths, header, (counts * dtype.itemsize).tolist())
    token_split = TokenSplit(tuple(paths), dtype, header, np.concatenate([[0], np.cumsum(counts)]),
                             fingerprint)
    if len(paths) > 1:
        log.info(f"data: {split}: {describe(token_split)}, {token_split.n_tokens:,} tokens")
    expected = (meta or {}).get("splits", {}).get(split, {}).get("fingerprint")
    if expected is not None and expected != fingerprint:
        raise UserError(f"{describe(token_split)} {'does' if len(paths) == 1 else 'do'} not match "
                        f"the fingerprint in {META_NAME}: the content changed after prepare.py "
                        f"wrote it (a different file of the same size?). Run `{hint}` again.")
    check_block_size(token_split, block_size)
    return token_split


def describe(token_split):
    """The split's file, or its shards, as a message names them."""
    first, last = token_split.paths[0], token_split.paths[-1]
    return first if len(token_split.paths) == 1 else \
        f"the {len(token_split.paths)} shards {os.path.basename(first)} to " \
        f"{os.path.basename(last)} in {os.path.dirname(first)}"


def check_block_size(token_split, block_size):
    """A window (a block and its shifted target, block_size + 1 tokens) lies inside one file:
    at least one file must hold one, or sampling has nothing to draw from."""
    longest = int(np.diff(token_split.starts).max())
    if longest < block_size + 1 and len(token_split.paths) == 1:
        raise UserError(f"{describe(token_split)} holds {longest} tokens, fewer than one block of "
                        f"block_size={block_size} plus the shifted target: set block_size to at "
                        f"most {max(longest - 1, 0)} or prepare more data.")
    if longest < block_size + 1:
        raise UserError(f"{describe(token_split)} hold at most {longest} tokens a shard, fewer "
                        f"than one block of block_size={block_size} plus the shifted target, and "
                        f"no window crosses from one shard into the next: prepare the data again "
                        f"with larger shards (--shard_tokens={block_size + 1} or more), or set "
                        f"block_size to at most {max(longest - 1, 0)}.")


def read(token_split, offsets, length):
    """The tokens [o, o + length) of the split for each offset o, as a (len(offsets), length)
    array. A window cut at its file's end (the module docstring) has 0 in the rest of its row."""
    offsets = np.asarray(offsets, dtype=np.int64)
    files = np.searchsorted(token_split.starts, offsets, side="right") - 1
    by_file = {}  # {file: [(row, offset in the file), ...]}, grouped in python: a batch has few
    for row, (k, o) in enumerate(zip(files.tolist(),
                                     (offsets - token_split.starts[files]).tolist())):
        by_file.setdefault(k, []).append((row, o))
    out = np.zeros((len(offsets), length), dtype=token_split.dtype)
    for k, windows in by_file.items():
        read_file(token_split, k, windows, length, memoryview(out).cast("B"))
    return out


def read_file(token_split, k, windows, length, out):
    """The windows (row, offset) of file k into their rows of out (bytes), one pread each."""
    path, itemsize = token_split.paths[k], token_split.dtype.itemsize
    n_tokens = int(token_split.starts[k + 1] - token_split.starts[k])
    row_bytes, short = length * itemsize, False
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            for row, o in windows:
                want = min(length, n_tokens - o) * itemsize
                window = os.pread(fd, want, token_split.header_bytes + o * itemsize)
                out[row * row_bytes:row * row_bytes + len(window)] = window
                short = short or len(window) != want
        finally:
            os.close(fd)
    except OSError as e:
        raise UserError(f"{path} could not be read during the run ({e.strerror}). "
                        f"{restore(path)}") from None
    if short:
        raise UserError(f"{path} is shorter than the {n_tokens} tokens it held at start-up: it "
                        f"was truncated or replaced during the run. {restore(path)}")


def restore(path):
    return f"Restore it, or run `{PREPARE_HINT.format(os.path.dirname(path))}` and resume."
