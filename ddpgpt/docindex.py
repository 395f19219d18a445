"""A split's document index, in one home: its format (described here only), building it, and
reading it.

<data_dir>/train.docidx, val.docidx: a split's document index, for sampling='documents'
(data.py). prepare.py writes it with the token files; `python index_documents.py
--data_dir=<data_dir>` makes it for token files without one (nanoGPT's, llm.c's, older ddpgpt
folders). A document starts at its file's first token and after every end-of-text id, and ends
where the next one starts. Little-endian:
  a header of 512 bytes: "DDPGDOCS", then int64 format version 1, documents D, distinct
  document lengths H, the split's tokens, its files and its end-of-text id (-1: none, each
  file is one document), then two fingerprints of 32 hex digits (ASCII): the split's, which
  its token files must still match (tokenfile.sampled_fingerprint, as meta.json's), and the
  index's own (sampled_fingerprint of the rest of this file);
  int64[D]: each document's first token in the split's token space, the longest document
  first, documents of one length in file order;
  int64[H] and int64[H]: the distinct lengths, longest first, and how many documents have
  each.
In length order, the documents that hold a k-th start for any block_size are the first ones,
so the starts of a block_size follow from the H lengths alone (data.py), and H is at most
sqrt(2 x tokens).

A run checks the index against its token files and their end-of-text id at start-up
(open_doc_index), then reads the entries it needs with one os.pread each, as tokenfile.py reads
windows: the index is never loaded, nor mapped (a memory map would keep its pages, and end the
process with SIGBUS if the file were cut under it).

Building it (Writer, build) takes memory that does not grow with the data, and publishes the index
whole or not at all (fileio), as prepare.py writes the token files or from token files that have
none (index_documents.py). The documents' first tokens are kept in file order in a temporary file as
they come: from the lengths prepare.py writes, or from a scan of the tokens for end-of-text ids
(scan()). finish() then reads that file twice: once to count the documents of each length, once to
put each first token at its place in length order, a counting sort that fills WINDOW places a pass.
"""
import os
import struct
from typing import NamedTuple, Optional

import numpy as np

from ddpgpt import fileio, tokenfile
from ddpgpt.errors import UserError

DOCS_SUFFIX, DOCS_MAGIC, DOCS_VERSION, DOCS_HEADER_BYTES = ".docidx", b"DDPGDOCS", 1, 512
DOCS_HEADER = struct.Struct("<8s6q32s32s")  # magic, 6 int64 as above, two fingerprints
INDEX_HINT = "python index_documents.py --data_dir={}"
CHUNK_TOKENS = 1 << 24  # tokens scanned at a time: 32 MiB of uint16
CHUNK_DOCS = 1 << 22  # first tokens read back at a time: 32 MiB
WINDOW = 1 << 24  # places of the index filled per pass: 128 MiB, and 1 pass below 16M documents


class DocIndex(NamedTuple):
    """A split's document index (the format above), checked: where it is and its sizes, never
    its contents, so that it pickles small and costs no memory."""
    path: str
    documents: int
    lengths: int  # distinct document lengths
    eot: Optional[int]  # the end-of-text id that ends its documents; None: one per file


# ---- reading ----

def doc_index_path(data_dir, split):
    return os.path.join(data_dir, split + DOCS_SUFFIX)


def read_doc_header(path):
    """(documents, lengths, eot, the split's fingerprint, its own) of an index file; ValueError
    saying what is wrong with one that is not whole."""
    with open(path, "rb") as f:
        head = f.read(DOCS_HEADER_BYTES)
    if len(head) < DOCS_HEADER.size or head[:8] != DOCS_MAGIC:
        raise ValueError("it does not start with a ddpgpt document index's header")
    _, version, documents, lengths, _, _, eot, split_fp, own_fp = DOCS_HEADER.unpack_from(head)
    if version != DOCS_VERSION:
        raise ValueError(f"format version {version}; this code reads {DOCS_VERSION}")
    size, expected = os.path.getsize(path), DOCS_HEADER_BYTES + 8 * (documents + 2 * lengths)
    if size != expected:
        raise ValueError(f"{size} bytes, where its header's {documents} documents and {lengths} "
                         f"lengths take {expected}: it was cut short or written over")
    return documents, lengths, None if eot < 0 else eot, split_fp.decode(), own_fp.decode()


def open_doc_index(token_split, data_dir, split):
    """The split's DocIndex, checked against its token files, their end-of-text id and its own
    fingerprint, at the cost of 64 small reads: a UserError naming the command that makes it,
    if it is missing, damaged or of other token files or another id."""
    path, files = doc_index_path(data_dir, split), tokenfile.describe(token_split)
    make = f"`{INDEX_HINT.format(data_dir)}`"
    if not os.path.isfile(path):
        raise UserError(f"{path} does not exist: it is the document index of {files}, which "
                        f"sampling='documents' reads. Make it with {make} (it reads the token "
                        f"files once; prepare.py writes it with them).")
    try:
        documents, lengths, eot, split_fp, own_fp = read_doc_header(path)
    except ValueError as e:
        raise UserError(f"{path} is not a document index that this code reads ({e}). Make it "
                        f"again with {make}.") from None
    if split_fp != token_split.fingerprint:
        raise UserError(f"{path} is the document index of other token files than {files}: they "
                        f"were made again, or changed, after it was. Make it again with {make}.")
    if own_fp != tokenfile.sampled_fingerprint([path], DOCS_HEADER_BYTES):
        raise UserError(f"{path} does not match its own fingerprint: it was damaged or written "
                        f"over after it was made. Make it again with {make}.")
    meta = tokenfile.read_meta(data_dir)  # None: raw files, indexed at the id a user gave
    if meta is not None and eot != meta.get("eot_token"):
        raise UserError(
            f"{path} ends documents {ending(eot)}, but {files} ({meta.get('tokenizer')!r} "
            f"tokens) end them {ending(meta.get('eot_token'))}: it cuts them elsewhere (it was "
            f"made on a copy without {tokenfile.META_NAME}, or before index_documents.py refused "
            f"another --eot_token). Make it again with {make}.")
    return DocIndex(path, documents, lengths, eot)


def ending(eot):
    return f"at end-of-text id {eot}" if eot is not None else "only at the end of each file"


def doc_lengths(index):
    """(the distinct document lengths, longest first, and the documents of each): int64 arrays
    of the index's H entries."""
    values = np.fromfile(index.path, dtype="<i8", count=2 * index.lengths,
                         offset=DOCS_HEADER_BYTES + 8 * index.documents)
    return values[:index.lengths].astype(np.int64), values[index.lengths:].astype(np.int64)


def doc_starts(index, places):
    """The first token of the documents at these places in length order (longest first), one
    pread each."""
    make = f"`{INDEX_HINT.format(os.path.dirname(index.path))}`"
    try:
        fd = os.open(index.path, os.O_RDONLY)
        try:
            raw = b"".join(os.pread(fd, 8, DOCS_HEADER_BYTES + 8 * p) for p in places.tolist())
        finally:
            os.close(fd)
    except OSError as e:
        raise UserError(f"{index.path} could not be read during the run ({e.strerror}): make it "
                        f"again with {make}, and resume.") from None
    if len(raw) != 8 * len(places):
        raise UserError(f"{index.path} is shorter than it was at start-up: it was cut or "
                        f"replaced during the run. Make it again with {make}, and resume.")
    return np.frombuffer(raw, dtype="<i8").astype(np.int64)


# ---- building ----

class Writer:
    """One split's index: add() its documents' first tokens in file order, then finish()."""

    def __init__(self, path):
        self.path, self.documents = path, 0
        self.starts_path = fileio.tmp_path(path + ".starts")  # in file order, this run's own
        self.file = open(self.starts_path, "wb")

    def add(self, starts):
        """First tokens of the next documents, in the split's token space."""
        fileio.write_array(self.file, np.asarray(starts, dtype="<i8"))
        self.documents += len(starts)

    def finish(self, token_split, eot):
        """Write the index of token_split (whose documents were all added, ended by eot, or None)
        under a temporary name and publish it; the temporary files go, whatever happens."""
        self.file.close()
        try:
            with fileio.publishing(self.path) as tmp:
                lengths, counts = self.histogram(token_split.n_tokens)
                with open(tmp, "wb") as out:
                    out.write(bytes(DOCS_HEADER_BYTES))  # written last, with fingerprints
                    self.write_by_length(out, lengths, counts, token_split.n_tokens)
                    fileio.write_array(out, np.concatenate([lengths, counts]).astype("<i8"))
                own = tokenfile.sampled_fingerprint([tmp], DOCS_HEADER_BYTES)
                with open(tmp, "r+b") as out:  # the header, in the format above
                    out.write(DOCS_HEADER.pack(
                        DOCS_MAGIC, DOCS_VERSION, self.documents, len(lengths),
                        token_split.n_tokens, len(token_split.paths), -1 if eot is None else eot,
                        token_split.fingerprint.encode(), own.encode()))
        finally:
            self.discard()

    def discard(self):
        fileio.discard(self.file)

    def in_file_order(self, n_tokens):
        """(first tokens, lengths) of the documents added, CHUNK_DOCS at a time: a document ends
        where the next starts, the last at the split's end (every file starts one)."""
        with open(self.starts_path, "rb") as f:
            starts = np.fromfile(f, dtype="<i8", count=CHUNK_DOCS)
            while len(starts):
                following = np.fromfile(f, dtype="<i8", count=CHUNK_DOCS)
                ends = np.append(starts[1:], following[0] if len(following) else n_tokens)
                yield starts, ends - starts
                starts = following

    def histogram(self, n_tokens):
        """(the distinct lengths, longest first, and the documents of each)."""
        lengths, counts = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        for _, chunk in self.in_file_order(n_tokens):
            values, found = np.unique(chunk, return_counts=True)
            merged = np.union1d(lengths, values)
            total = np.zeros(len(merged), dtype=np.int64)
            total[np.searchsorted(merged, lengths)] += counts
            total[np.searchsorted(merged, values)] += found
            lengths, counts = merged, total
        return lengths[::-1].copy(), counts[::-1].copy()

    def write_by_length(self, out, lengths, counts, n_tokens):
        """The first tokens, longest document first and in file order within a length: the
        documents of length lengths[b] take the places from first[b] on, in the order they
        come. Each pass over the documents fills the places [a, a + WINDOW)."""
        first = np.concatenate([[0], np.cumsum(counts)[:-1]])
        ascending = lengths[::-1]
        for a in range(0, self.documents, WINDOW):
            window = np.empty(min(WINDOW, self.documents - a), dtype="<i8")
            seen = np.zeros(len(lengths), dtype=np.int64)  # documents of each length so far
            for starts, chunk in self.in_file_order(n_tokens):
                bucket = len(lengths) - 1 - np.searchsorted(ascending, chunk)
                # as uint16, where the lengths allow, numpy's stable sort is a radix sort
                order = np.argsort(bucket.astype(np.uint16) if len(lengths) <= 2**16 else bucket,
                                   kind="stable")
                ranked = bucket[order]
                within = np.arange(len(ranked)) - np.searchsorted(ranked, ranked)
                place = first[ranked] + seen[ranked] + within - a
                inside = (place >= 0) & (place < len(window))
                window[place[inside]] = starts[order[inside]]
                seen += np.bincount(bucket, minlength=len(lengths))
            fileio.write_array(out, window)


def scan(token_split, k, eot, on_chunk=lambda n_tokens: None):
    """The first tokens of file k's documents, in the split's token space, as arrays: its
    first token, and each one after an end-of-text id (eot None: the file is one document).
    CHUNK_TOKENS at a time, each chunk mapped and unmapped again, so that what was read stays
    in the page cache and not in this process (and no copy is made); on_chunk(tokens) after
    each. The lock that prepare.py takes keeps the files from changing under the map."""
    first, end = int(token_split.starts[k]), int(token_split.starts[k + 1])
    if end == first:
        return
    yield np.array([first], dtype=np.int64)
    if eot is None:
        on_chunk(end - first)
        return
    itemsize = token_split.dtype.itemsize
    with open(token_split.paths[k], "rb") as f:
        for at in range(first, end, CHUNK_TOKENS):
            n = min(CHUNK_TOKENS, end - at)
            chunk = np.memmap(f, dtype=token_split.dtype, mode="r", shape=(n,),
                              offset=token_split.header_bytes + (at - first) * itemsize)
            after = np.flatnonzero(chunk == eot) + (at + 1)
            del chunk
            yield after[after < end]  # an end-of-text that ends the file starts nothing
            on_chunk(n)


def build(token_split, path, eot, on_chunk=lambda n_tokens: None):
    """The index of token_split at path, from a scan of its token files."""
    writer = Writer(path)
    try:
        for k in range(len(token_split.paths)):
            for starts in scan(token_split, k, eot, on_chunk):
                writer.add(starts)
    except BaseException:
        writer.discard()
        raise
    writer.finish(token_split, eot)
