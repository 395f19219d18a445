"""Token files on disk: the format (described here only), writing meta.json, and checking and
reading a split.

  <data_dir>/train.bin, <data_dir>/val.bin
      Raw little-endian token ids, no header: uint16 when the vocabulary fits in 65,536 ids,
      else uint32. Every document is followed by the tokenizer's end-of-text id. Files made by
      nanoGPT's prepare.py are the same format (uint16).
  <data_dir>/meta.json, written last
      {"format_version": 1, "dtype": "uint16", "vocab_size": 50257, "tokenizer": "gpt2",
       "eot_token": 50256,
       "splits": {"train": {"tokens": N, "documents": D, "fingerprint": "..."}, "val": {...}},
       ... and how the files were made (prepare.py adds its source and settings)}
      "fingerprint" is sampled_fingerprint() of the file: its size and 64 evenly spaced 4 KiB
      chunks, so checking it costs the same for 16 MiB as for 16 GiB.
  A folder with .bin files and no meta.json is read as nanoGPT's raw uint16.

A TokenFile holds a path, a dtype and a length, never an open file: it pickles in a few hundred
bytes and works in any process, forked or spawned. Each read opens the file and reads each
window with one os.pread, so no page read stays in the resident memory of a long run, and a
random window costs one small read (a memmap faults in the disk's read-ahead around each
window; docs/benchmarks.md measures both).
"""
import hashlib
import json
import os
from typing import NamedTuple

import numpy as np

import fileio
from errors import UserError

FORMAT_VERSION = 1
META_NAME = "meta.json"
SPLITS = ("train", "val")
FINGERPRINT_CHUNKS, FINGERPRINT_CHUNK_BYTES = 64, 4096
PREPARE_HINT = "python prepare.py --out_dir={}"


class TokenFile(NamedTuple):
    path: str
    dtype: np.dtype
    n_tokens: int


def token_dtype(vocab_size):
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def sampled_fingerprint(path):
    size = os.path.getsize(path)
    h = hashlib.blake2b(str(size).encode(), digest_size=16)
    chunk = min(FINGERPRINT_CHUNK_BYTES, size)
    with open(path, "rb") as f:
        for i in range(FINGERPRINT_CHUNKS):
            f.seek((size - chunk) * i // (FINGERPRINT_CHUNKS - 1))
            h.update(f.read(chunk))
    return h.hexdigest()


# ---- writing: prepare.py streams into .tmp files; these describe and publish the result ----

def describe_split(path, dtype, documents):
    """meta.json's entry for a complete token file."""
    return {"tokens": os.path.getsize(path) // np.dtype(dtype).itemsize, "documents": documents,
            "fingerprint": sampled_fingerprint(path)}


def write_meta(data_dir, *, tokenizer, vocab_size, eot_token, splits, **provenance):
    """The one writer of meta.json; splits is {split: describe_split(...)}."""
    fileio.write_json(os.path.join(data_dir, META_NAME), {
        "format_version": FORMAT_VERSION, "dtype": token_dtype(vocab_size).name,
        "vocab_size": vocab_size, "tokenizer": tokenizer, "eot_token": eot_token,
        "splits": splits, **provenance})


def write_token_files(data_dir, ids_by_split, *, tokenizer, vocab_size, eot_token):
    """A complete data folder from in-memory arrays of ids, for small data (tests, benchmarks);
    prepare.py streams instead. Documents are counted by their end-of-text ids."""
    os.makedirs(data_dir, exist_ok=True)
    dtype, splits = token_dtype(vocab_size), {}
    for split, ids in ids_by_split.items():
        path = os.path.join(data_dir, f"{split}.bin")
        ids = np.asarray(ids, dtype=dtype)
        ids.tofile(path)
        splits[split] = describe_split(path, dtype, int(np.count_nonzero(ids == eot_token)))
    write_meta(data_dir, tokenizer=tokenizer, vocab_size=vocab_size, eot_token=eot_token,
               splits=splits)


# ---- reading ----

def read_meta(data_dir):
    """meta.json as a dict, or None for a nanoGPT-style folder that has none."""
    path = os.path.join(data_dir, META_NAME)
    if not os.path.exists(path):
        return None
    hint = PREPARE_HINT.format(data_dir)
    try:
        with open(path) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        problem = f"{type(e).__name__}: {e}"
    else:
        missing = [k for k in ("dtype", "splits", "vocab_size")
                   if not isinstance(meta, dict) or k not in meta]
        problem = f"it has no {', '.join(missing)}" if missing else None
    if problem:
        raise UserError(f"{path} is not a valid ddpgpt meta.json ({problem}). It is written "
                        f"last by prepare.py, so a damaged one means the folder is "
                        f"incomplete: run `{hint}` again.")
    if meta.get("format_version") != FORMAT_VERSION:
        raise UserError(
            f"{path} has format_version {meta.get('format_version')!r}, this code reads "
            f"{FORMAT_VERSION}: run `{hint}` again.")
    return meta


def open_split(data_dir, split, block_size, vocab_size=None, log=print):
    """Check one split on disk against meta.json and return its TokenFile."""
    meta = read_meta(data_dir)
    path = os.path.join(data_dir, f"{split}.bin")
    hint = PREPARE_HINT.format(data_dir)
    if not os.path.isfile(path):
        raise UserError(f"{path} does not exist: make the token files with `{hint}` "
                        f"or set data_dir to a folder that holds train.bin and val.bin.")
    if meta is None:
        log(f"data: {data_dir} has no {META_NAME}; reading {split}.bin as raw uint16 tokens "
            "(nanoGPT's format)")
        dtype, info = np.dtype(np.uint16), {}
    else:
        dtype, info = np.dtype(meta["dtype"]), meta["splits"].get(split, {})
    size = os.path.getsize(path)
    if size % dtype.itemsize:
        raise UserError(
            f"{path} is {size} bytes, which is not a whole number of {dtype.name} tokens "
            f"({dtype.itemsize} bytes each): the file is truncated or is not a token file. "
            f"Run `{hint}` again.")
    n_tokens = size // dtype.itemsize
    if "tokens" in info and info["tokens"] != n_tokens:
        raise UserError(
            f"{path} holds {n_tokens} tokens but {META_NAME} says {info['tokens']}: the file "
            f"was truncated, extended or replaced after prepare.py wrote it. Run `{hint}` again.")
    if "fingerprint" in info and info["fingerprint"] != sampled_fingerprint(path):
        raise UserError(
            f"{path} does not match the fingerprint in {META_NAME}: its content changed after "
            f"prepare.py wrote it (a different file of the same size?). Run `{hint}` again.")
    if n_tokens < block_size + 1:
        raise UserError(
            f"{path} holds {n_tokens} tokens, fewer than one block of block_size={block_size} "
            f"plus the shifted target: set block_size to at most {max(n_tokens - 1, 0)} or "
            f"prepare more data for the {split} split.")
    if vocab_size is not None and meta is not None and meta["vocab_size"] > vocab_size:
        raise UserError(
            f"{data_dir} was tokenized with {meta.get('tokenizer')!r}, whose {meta['vocab_size']} "
            f"ids do not fit the model's vocab_size={vocab_size}: use a model with vocab_size "
            f">= {meta['vocab_size']} or data prepared with a smaller vocabulary.")
    return TokenFile(path, dtype, n_tokens)


def read(token_file, offsets, length):
    """The tokens [o, o + length) for each offset o, as a (len(offsets), length) array."""
    path, dtype = token_file.path, token_file.dtype
    n_bytes = length * dtype.itemsize
    fix = f"Restore it, or run `{PREPARE_HINT.format(os.path.dirname(path))}` and resume."
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            raw = b"".join([os.pread(fd, n_bytes, o * dtype.itemsize) for o in offsets.tolist()])
        finally:
            os.close(fd)
    except OSError as e:
        raise UserError(f"{path} could not be read during the run ({e.strerror}). {fix}") from None
    if len(raw) != n_bytes * len(offsets):
        raise UserError(f"{path} is shorter than the {token_file.n_tokens} tokens it held at "
                        f"start-up: it was truncated or replaced during the run. {fix}")
    return np.frombuffer(raw, dtype=dtype).reshape(len(offsets), length)
