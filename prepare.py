"""
Turn a text corpus (corpus.py reads them) into token files for training, in the formats
tokenfile.py describes: <out_dir>/train.bin, val.bin and meta.json, or with --shard_tokens
shards of about that many tokens each, in ddpgpt's raw format or llm.c's (--format=llmc).

    python prepare.py                                       # OpenWebText, from the HF hub
    python prepare.py --dataset=path/to/openwebtext         # a copy of its archives, offline
    python prepare.py --dataset=pystdlib --tokenizer=byte   # needs no network
    python prepare.py --dataset=my_texts/ --out_dir=data/mine
    python prepare.py --dataset=HuggingFaceFW/fineweb-edu --hub_config=sample-10BT \\
        --streaming --shard_tokens=100000000 --format=llmc  # 10B tokens, never stored raw

The corpus is read twice: pass 1 counts its non-empty documents, which fixes the train/val
split up front (document d goes to val iff data.permute(d, documents, key(seed)) < n_val), and
pass 2 tokenizes. Documents stream through a pool of workers in chunks and their tokens are
appended to each split's file as they come back, so memory does not grow with the corpus
(OpenWebText is 9B tokens). A shard is published under its final name as soon as it is
complete, and prepare.progress.json records where the corpus stands after it, so a prepare
that dies at 90% and is run again with the same arguments goes on after the last complete
shard, and writes the same bytes as a run that never stopped.

One prepare at a time writes in an out_dir (fileio.locked): a second one is refused, naming
the first. Stopped by SIGINT, SIGTERM or SIGHUP, or by a full disk, it removes its temporary
files and says what it kept; what it published before stays as it was.
"""
import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time
from collections import deque
from multiprocessing import Pool

import numpy as np
from tqdm import tqdm

import corpus
import data
import fileio
import tokenfile
from errors import UserError
from tokenizer import get_tokenizer

CHUNK_CHARS = 1 << 20  # text sent to a worker at a time: big enough to amortise the pickling


def validation_size(args, n_docs, source):
    if n_docs == 0:
        raise UserError(f"the corpus ({source}) holds no non-empty documents: check "
                        f"--dataset and --text_column.")
    if n_docs == 1:
        raise UserError(f"the corpus ({source}) is a single document (a .txt file is one "
                        f"document), which cannot be split into training and validation "
                        f"data: pass several files (a folder or a glob), or a .jsonl file "
                        f"with one document per line.")
    if not 0 <= args.val_fraction < 1:
        raise UserError(f"--val_fraction={args.val_fraction} is not in [0, 1).")
    n_val = args.val_docs if args.val_docs is not None else \
        max(1, round(n_docs * args.val_fraction))
    if not 1 <= n_val < n_docs:
        raise UserError(f"{n_val} validation documents out of the corpus's {n_docs} non-empty "
                        f"ones ({source}) leave no training or no validation data: pass a "
                        f"--val_docs or --val_fraction that keeps 1 to {n_docs - 1} documents "
                        f"for validation.")
    return n_val


# ---- pass 2: tokenizing in a pool of workers, in corpus order ----

def chunks(texts, n_docs, n_val, key, next_doc):
    """(texts, the split of each, the index of each) about CHUNK_CHARS characters at a time.
    Non-empty documents are counted from 0 in corpus order; those a resumed run has written
    already (index < next_doc[split]) are left out, untokenized."""
    batch, size, first = [], 0, 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= CHUNK_CHARS:
            yield split_chunk(batch, first, n_docs, n_val, key, next_doc)
            first += len(batch)
            batch, size = [], 0
    if batch:
        yield split_chunk(batch, first, n_docs, n_val, key, next_doc)


def split_chunk(texts, first, n_docs, n_val, key, next_doc):
    indices = np.arange(first, first + len(texts))
    splits = np.where(data.permute(indices, n_docs, key) < n_val, "val", "train")
    keep = [i for i, (split, index) in enumerate(zip(splits, indices))
            if index >= next_doc[split]]
    return ([texts[i] for i in keep], [str(splits[i]) for i in keep],
            [int(indices[i]) for i in keep])


_tokenizer = None  # each worker's own


def init_worker(tokenizer_name):
    corpus.worker_signals()
    global _tokenizer
    _tokenizer = get_tokenizer(tokenizer_name)


def encode_chunk(task):
    """{split: (its documents' tokens, each document's length, each one's index)}."""
    texts, splits, indices = task
    out = {split: ([], [], []) for split in tokenfile.SPLITS}
    for text, split, index in zip(texts, splits, indices):
        ids, lengths, where = out[split]
        before = len(ids)
        ids.extend(_tokenizer.encode(text))
        ids.append(_tokenizer.eot)
        lengths.append(len(ids) - before)
        where.append(index)
    dtype = tokenfile.token_dtype(_tokenizer.vocab_size)
    return {split: (np.array(ids, dtype=dtype), lengths, where)
            for split, (ids, lengths, where) in out.items()}


def ordered_map(pool, fn, items, ahead):
    """pool.imap, reading at most `ahead` items ahead of the results: imap's feeder thread
    would pull the whole corpus into memory whenever reading is faster than encoding."""
    pending = deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= ahead:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


# ---- output: each file written under a temporary name and renamed when complete ----

class SplitWriter:
    """One split's token files. Documents' tokens are appended to a temporary file of this
    process's own (fileio.tmp_path) that is renamed to its final name when complete: at the
    end, or for shards as soon as the shard holds shard_tokens tokens, at the end of a document
    (a shard holds whole documents, so it can be resumed from a document index). llm.c's
    header is written last, with the token count."""

    def __init__(self, out_dir, split, dtype, args, published, on_publish):
        self.out_dir, self.split, self.dtype = out_dir, split, dtype
        self.on_publish = on_publish  # records each shard in the progress file as it appears
        self.sharded = bool(args.shard_tokens) or args.format == "llmc"
        self.shard_tokens = args.shard_tokens or math.inf
        self.prefix = f"{args.llmc_name}_" if args.format == "llmc" else ""
        self.header_bytes = tokenfile.LLMC_HEADER_BYTES if args.format == "llmc" else 0
        self.shards = list(published)  # meta.json's entries, plus where each leaves the corpus
        self.file, self.tokens, self.documents = None, 0, 0

    def name(self):
        if not self.sharded:
            return f"{self.split}.bin"
        return f"{self.prefix}{self.split}_{len(self.shards):06d}.bin"

    def write(self, ids, lengths, indices):
        """Append documents."""
        ends, done = np.cumsum(lengths), 0
        while done < len(lengths):
            if self.file is None:
                self.file = open(fileio.tmp_path(os.path.join(self.out_dir, self.name())), "wb")
                self.file.write(bytes(self.header_bytes))  # room for llm.c's header
            # up to the first document that fills the shard, or all of them
            last = min(int(np.searchsorted(ends, ends[done] - lengths[done] - self.tokens
                                           + self.shard_tokens)), len(lengths) - 1)
            first_token, end_token = int(ends[done] - lengths[done]), int(ends[last])
            ids[first_token:end_token].tofile(self.file)
            self.tokens += end_token - first_token
            self.documents += last + 1 - done
            done = last + 1
            if self.tokens >= self.shard_tokens:
                self.publish(next_doc=indices[last] + 1)
                self.on_publish()

    def publish(self, next_doc):
        path = os.path.join(self.out_dir, self.name())
        if self.header_bytes:
            self.file.seek(0)
            self.file.write(np.array([tokenfile.LLMC_MAGIC, tokenfile.LLMC_VERSION, self.tokens],
                                     dtype="<i4").tobytes())
        self.file.close()
        old_meta = os.path.join(self.out_dir, tokenfile.META_NAME)
        if os.path.exists(old_meta):  # it vouches for the files this one may replace
            os.remove(old_meta)
        fileio.publish(self.file.name, path)
        self.shards.append({"file": self.name(), "tokens": self.tokens,
                            "documents": self.documents, "next_doc": next_doc,
                            "fingerprint": tokenfile.sampled_fingerprint([path],
                                                                         self.header_bytes)})
        self.file, self.tokens, self.documents = None, 0, 0

    def finish(self):
        """Publish what is left, and meta.json's entry for the split."""
        if self.file is not None:
            self.publish(next_doc=None)
        paths = [os.path.join(self.out_dir, s["file"]) for s in self.shards]
        entry = {"tokens": sum(s["tokens"] for s in self.shards),
                 "documents": sum(s["documents"] for s in self.shards),
                 "fingerprint": tokenfile.sampled_fingerprint(paths, self.header_bytes)}
        if self.sharded:
            entry["shards"] = [{k: s[k] for k in ("file", "tokens", "documents", "fingerprint")}
                               for s in self.shards]
        return entry

    def discard(self):
        if self.file is not None:
            self.file.close()
            with contextlib.suppress(FileNotFoundError):  # stopped just after publishing it
                os.remove(self.file.name)


# ---- resuming: prepare.progress.json, rewritten after each published shard ----

def output_settings(args):
    """What decides the bytes of the output: a run resumes only with the same."""
    keys = ("dataset", "hub_config", "text_column", "tokenizer", "val_fraction", "val_docs",
            "seed", "shard_tokens", "format", "llmc_name", "streaming")
    return {k: getattr(args, k) for k in keys}


def read_progress(out_dir, args):
    """The progress of an interrupted run with the same settings whose shards are all still
    there, else None (and what such a run left is removed: it would be overwritten anyway)."""
    path = os.path.join(out_dir, tokenfile.PROGRESS_NAME)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            progress = json.load(f)
    except (OSError, ValueError):  # a progress file is written whole, so this is not ours
        progress = {"settings": None, "splits": {}, "header_bytes": 0}
    shards = [s for split in progress["splits"].values() for s in split]
    intact = all(os.path.isfile(os.path.join(out_dir, s["file"])) and s["fingerprint"] ==
                 tokenfile.sampled_fingerprint([os.path.join(out_dir, s["file"])],
                                               progress["header_bytes"]) for s in shards)
    if progress["settings"] == output_settings(args) and intact:
        print(f"prepare.py: resuming an interrupted run in {out_dir}: "
              f"{len(shards)} complete shard(s) kept")
        return progress
    print(f"prepare.py: {out_dir} holds an interrupted run with other settings, or with "
          f"shards missing or changed: starting over")
    for s in shards:
        if os.path.isfile(os.path.join(out_dir, s["file"])):
            os.remove(os.path.join(out_dir, s["file"]))
    os.remove(path)
    return None


def save_progress(out_dir, args, counts, writers):
    fileio.write_json(os.path.join(out_dir, tokenfile.PROGRESS_NAME), {
        "settings": output_settings(args), "counts": counts,
        "header_bytes": writers["train"].header_bytes,
        "splits": {split: w.shards for split, w in writers.items()}})


def write_tokens(writers, texts, counts, n_val, args):
    """Pass 2: tokenize the documents not written yet, appending them to their split."""
    next_doc = {split: w.shards[-1]["next_doc"] if w.shards else 0
                for split, w in writers.items()}
    done = sum(s["documents"] for w in writers.values() for s in w.shards)
    work = chunks(texts, counts["documents"], n_val, data.hash_key(args.seed), next_doc)
    with Pool(args.num_proc, init_worker, (args.tokenizer,)) as pool, \
            tqdm(total=counts["documents"], initial=done, desc="tokenizing",
                 unit=" docs") as bar:
        for result in ordered_map(pool, encode_chunk, work, ahead=2 * args.num_proc):
            for split, tokens in result.items():
                writers[split].write(*tokens)
            bar.update(sum(len(lengths) for _, lengths, _ in result.values()))


def prepare(args):
    if args.num_proc < 1:
        raise UserError(f"--num_proc={args.num_proc}: use at least 1 process.")
    if args.shard_tokens < 0:
        raise UserError(f"--shard_tokens={args.shard_tokens}: use 0 (no shards) or a number "
                        f"of tokens per shard, such as 100000000.")
    tokenizer = get_tokenizer(args.tokenizer)
    if args.format == "llmc" and tokenizer.vocab_size > 2**16:
        raise UserError(f"--format=llmc holds uint16 GPT-2 tokens; {args.tokenizer!r} has "
                        f"{tokenizer.vocab_size} ids: use --format=raw.")
    name, source, documents, count = corpus.open_source(
        args.dataset, args.text_column, args.num_proc, args.streaming, args.hub_config)
    out_dir = args.out_dir or os.path.join("data", name)
    if os.path.isdir(args.dataset) and os.path.realpath(out_dir) == \
            os.path.realpath(args.dataset):
        raise UserError(f"--out_dir={out_dir} is the corpus folder itself: its token files and "
                        f"meta.json would be mixed with the documents. Pass an --out_dir "
                        f"outside it, or a folder inside it (which prepare.py skips when it "
                        f"reads the corpus).")
    args.llmc_name = name.replace("_", "-")  # llm.c's names are <name>_<split>_<index>.bin
    with fileio.locked(out_dir, "prepare.py"):  # a second prepare would destroy this one's output
        stale = fileio.remove_stale_temporaries(out_dir)
        if stale:
            print(f"prepare.py: removed {len(stale)} temporary file(s) that a killed run left "
                  f"in {out_dir}")
        progress = read_progress(out_dir, args)
        counts = progress["counts"] if progress else count()
        n_val = validation_size(args, counts["documents"], source)
        dtype, published = tokenfile.token_dtype(tokenizer.vocab_size), \
            (progress or {}).get("splits", {})
        writers = {split: SplitWriter(out_dir, split, dtype, args, published.get(split, []),
                                      lambda: save_progress(out_dir, args, counts, writers))
                   for split in tokenfile.SPLITS}
        splits = write_outputs(out_dir, writers, tokenizer, documents, counts, n_val, source,
                               args)
    return out_dir, splits, counts


def write_outputs(out_dir, writers, tokenizer, documents, counts, n_val, source, args):
    """Pass 2 and meta.json. On every way out before the end (an error, a full disk, a signal)
    this run's temporary files are removed, and the shards it published stay, with the
    progress file that resumes after them."""
    try:
        write_tokens(writers, filter(corpus.is_document, documents()), counts, n_val, args)
        splits = {split: w.finish() for split, w in writers.items()}
        tokenfile.write_meta(
            out_dir, tokenizer=tokenizer.name, vocab_size=tokenizer.vocab_size,
            eot_token=tokenizer.eot, splits=splits, source=args.dataset, source_detail=source,
            text_column=args.text_column, seed=args.seed,
            val_selection=f"non-empty document d (from 0, in corpus order) is in val iff "
                          f"data.permute(d, {counts['documents']}, data.hash_key({args.seed})) "
                          f"< {n_val}",
            skipped_empty_documents=counts["empty"],
            skipped_undecodable_files=counts["undecodable"],
            **({"format": "llmc"} if args.format == "llmc" else {}),
            **({"shard_tokens": args.shard_tokens} if args.shard_tokens else {}))
    except BaseException as e:
        full = isinstance(e, OSError) and fileio.disk_full(e, out_dir)  # before space is freed
        for w in writers.values():
            w.discard()
        if full:
            raise UserError(f"{full}. Nothing published before was damaged: "
                            f"{what_is_left(out_dir, writers)}. Free space there, or pass an "
                            f"--out_dir on a disk with room, and run again.") from e
        if isinstance(e, Interrupted):
            e.left = what_is_left(out_dir, writers)
        raise
    if os.path.exists(os.path.join(out_dir, tokenfile.PROGRESS_NAME)):
        os.remove(os.path.join(out_dir, tokenfile.PROGRESS_NAME))
    return splits


def what_is_left(out_dir, writers):
    """What a run that stopped before the end leaves in out_dir, after its writers' discard:
    the progress file says what the same command resumes after."""
    path = os.path.join(out_dir, tokenfile.PROGRESS_NAME)
    recorded = 0
    if os.path.exists(path):
        with open(path) as f:
            recorded = sum(map(len, json.load(f)["splits"].values()))
    published = sum(len(w.shards) for w in writers.values())
    removed = "this run's temporary files were removed"
    if recorded:
        return (f"{removed}, and the {recorded} complete shard(s) in {out_dir} that "
                f"{tokenfile.PROGRESS_NAME} records are kept: the same command resumes after them")
    if published:  # the progress file could not be written after the first shard
        return (f"{removed}; the {published} shard(s) it published are not recorded in "
                f"{tokenfile.PROGRESS_NAME}, so the same command starts over")
    return f"{removed}, and no new output was published"


# ---- stopping: SIGINT (Ctrl-C), SIGTERM (kill, a scheduler) and SIGHUP (a closed terminal) ----

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """A stop signal, raised in the main process wherever it is, so that every way out runs
    the cleanup that Ctrl-C runs (a KeyboardInterrupt, which libraries let through too). The
    workers ignore SIGINT and SIGHUP and die quietly of SIGTERM (corpus.worker_signals)."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.left = signum, "no new output was published"


def stop(signum, frame):
    for s in STOP_SIGNALS:  # a second signal must not cut the cleanup short
        signal.signal(s, signal.SIG_IGN)
    raise Interrupted(signum)


def parse_args():
    p = argparse.ArgumentParser(
        description="Tokenize a corpus into token files and meta.json (format: tokenfile.py): "
                    "each non-empty document followed by end-of-text; empty ones are skipped.")
    p.add_argument("--dataset", default="openwebtext", help=(
        "'openwebtext': all of OpenWebText, its 21 archives from the hub repository "
        f"{corpus.OWT_REPO} (about 13 GB, downloaded to the Hugging Face cache the first "
        "time), or a folder holding a copy of them (subsets/urlsf_subset*.tar); another "
        "Hugging Face hub dataset (its train split; needs network the first time); local "
        "files: a .txt file (one document), .jsonl (an object per line), .json (a list of "
        "objects, or JSON lines if it does not start with '['), .parquet (a document per row), "
        "any of the first three compressed (.gz, .bz2, .xz, .zst); a folder (all such files in "
        "it, recursively, sorted, each once; the rest is skipped with a line per kind) or a "
        "quoted glob; or 'pystdlib': "
        "the .py files of this Python's standard library, a document each, no network needed. "
        "Default: %(default)s"))
    p.add_argument("--text_column", default="text",
                   help="the field or column that holds the text (default: %(default)s)")
    p.add_argument("--hub_config", help="a hub dataset's subset, e.g. sample-10BT")
    p.add_argument("--streaming", action="store_true",
                   help="stream a hub dataset (or local .parquet files) instead of storing it: "
                        "for corpora larger than the disk; each of the two passes streams it")
    p.add_argument("--out_dir", help="default: data/<dataset name, or file or folder stem>")
    p.add_argument("--tokenizer", default="gpt2",
                   help="a tiktoken encoding, or 'byte' (default: %(default)s)")
    val = p.add_mutually_exclusive_group()
    val.add_argument("--val_fraction", type=float, default=0.0005,
                     help="fraction of the documents for validation, rounded, at least "
                          "one document (default: %(default)s)")
    val.add_argument("--val_docs", type=int, help="number of documents for validation")
    p.add_argument("--seed", type=int, default=2357,
                   help="chooses the validation documents (default: %(default)s)")
    p.add_argument("--shard_tokens", type=int, default=0,
                   help="write shards of about this many tokens (whole documents), each "
                        "published when complete, so an interrupted run resumes; 0: one file "
                        "per split (default: %(default)s)")
    p.add_argument("--format", choices=("raw", "llmc"), default="raw",
                   help="raw: ddpgpt's (and nanoGPT's) headerless files; llmc: llm.c / "
                        "modded-nanogpt shards, <name>_<split>_<index>.bin with llm.c's header "
                        "(default: %(default)s)")
    p.add_argument("--num_proc", type=int, default=os.cpu_count(),
                   help="tokenizer processes, and for OpenWebText the processes that count "
                        "its archives' documents (default: one per core, %(default)s)")
    return p.parse_args()


def main():
    for s in STOP_SIGNALS:
        if signal.getsignal(s) is not signal.SIG_IGN:  # nohup's, or a background job's SIGINT
            signal.signal(s, stop)
    args = parse_args()
    t0 = time.time()
    try:
        out_dir, splits, counts = prepare(args)
    except (UserError, OSError) as e:
        sys.exit(f"prepare.py: error: {e}")
    except Interrupted as e:  # the shell's convention: 128 + the signal's number
        print(f"prepare.py: interrupted ({e}); {e.left}.", file=sys.stderr)
        sys.exit(128 + e.signum)
    elapsed = time.time() - t0
    for split, entry in splits.items():
        files = [s["file"] for s in entry.get("shards", [])] or [f"{split}.bin"]
        size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in files)
        where = os.path.join(out_dir, files[0]) + (f" and {len(files) - 1} more shard(s)"
                                                   if len(files) > 1 else "")
        print(f"{split:5s}: {entry['tokens']:,} tokens, {entry['documents']:,} documents -> "
              f"{where} ({size / 1e6:.1f} MB)")
    print(f"meta : {os.path.join(out_dir, tokenfile.META_NAME)}")
    print(f"skipped {counts['empty']:,} empty documents, {counts['undecodable']:,} undecodable "
          f"files; {sum(e['tokens'] for e in splits.values()) / elapsed:,.0f} tokens/s, "
          f"{elapsed:.1f} s in all")


if __name__ == "__main__":
    main()
