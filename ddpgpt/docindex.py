"""Building a split's document index (the format is tokenfile.py's, and reading it): as
prepare.py writes the token files, or from token files that have none (index_documents.py).
Either way in memory that does not grow with the data, published whole or not at all (fileio).

The documents' first tokens are kept in file order in a temporary file as they come: from the
lengths prepare.py writes, or from a scan of the tokens for end-of-text ids (scan()). finish()
then reads that file twice: once to count the documents of each length, once to put each first
token at its place in length order, a counting sort that fills WINDOW places a pass.
"""
import contextlib
import os

import numpy as np

from ddpgpt import fileio, tokenfile

CHUNK_TOKENS = 1 << 24  # tokens scanned at a time: 32 MiB of uint16
CHUNK_DOCS = 1 << 22  # first tokens read back at a time: 32 MiB
WINDOW = 1 << 24  # places of the index filled per pass: 128 MiB, and 1 pass below 16M documents


class Writer:
    """One split's index: add() its documents' first tokens in file order, then finish()."""

    def __init__(self, path):
        self.path, self.documents = path, 0
        self.starts_path = fileio.tmp_path(path + ".starts")  # in file order, this run's own
        self.file = open(self.starts_path, "wb")

    def add(self, starts):
        """First tokens of the next documents, in the split's token space."""
        np.asarray(starts, dtype="<i8").tofile(self.file)
        self.documents += len(starts)

    def finish(self, token_split, eot):
        """Write the index of token_split (whose documents were all added, ended by eot, or None)
        under a temporary name and publish it; the temporary files go, whatever happens."""
        self.file.close()
        tmp = fileio.tmp_path(self.path)
        try:
            lengths, counts = self.histogram(token_split.n_tokens)
            with open(tmp, "wb") as out:
                out.write(bytes(tokenfile.DOCS_HEADER_BYTES))  # written last, with fingerprints
                self.write_by_length(out, lengths, counts, token_split.n_tokens)
                np.concatenate([lengths, counts]).astype("<i8").tofile(out)
            own = tokenfile.sampled_fingerprint([tmp], tokenfile.DOCS_HEADER_BYTES)
            with open(tmp, "r+b") as out:
                out.write(tokenfile.doc_header(self.documents, len(lengths), token_split, eot,
                                               own))
            fileio.publish(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
            raise
        finally:
            self.discard()

    def discard(self):
        self.file.close()
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.starts_path)

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
            window.tofile(out)


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
