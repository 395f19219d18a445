"""The second reference of the prepare benchmark, the pipeline of llm.c's dev/data/fineweb.py,
written for this comparison from its description: load the corpus with the datasets library,
hand the documents to a multiprocessing pool one at a time (pool.imap, chunksize=16), where
each is one call of tiktoken's encode_ordinary with end-of-text in front, returned as a uint16
array; copy the arrays into a preallocated buffer of SHARD_TOKENS tokens, and write each full
buffer as a shard in llm.c's format (its 256-int32 header, then the tokens). As in llm.c, the
first shard is the validation split and a document that does not fit continues in the next
shard.

  python -m benchmarks.prepare_llmc_reference CORPUS.jsonl OUT_DIR NUM_PROC SHARD_TOKENS

Prints one JSON line: the tokens written and the seconds each phase took (tokenizing and
writing overlap: write_s is the time in writes, tokenize_s the rest of the loop).
"""
import json
import os
import sys
import time
from multiprocessing import Pool

import datasets
import numpy as np

from ddpgpt import tokenfile
from ddpgpt.tokenizer import get_tokenizer

# made before the pool, so the forked workers share it, as llm.c's module-level encoder is
TOKENIZER = get_tokenizer("gpt2")


def tokenize(document):
    """One document: end-of-text, then its tokens, as uint16."""
    ids = [TOKENIZER.eot]
    ids.extend(TOKENIZER.encode(document["text"]))
    ids = np.array(ids)
    assert ids.min() >= 0 and ids.max() < 2**16, "token ids do not fit uint16"
    return ids.astype(np.uint16)


class ShardWriter:
    """The preallocated buffer of one shard, written out whenever it is full."""

    def __init__(self, out_dir, shard_tokens):
        self.out_dir, self.buffer, self.count = out_dir, np.empty(shard_tokens, np.uint16), 0
        self.index, self.tokens, self.write_s = 0, 0, 0.0

    def add(self, ids):
        while self.count + len(ids) >= len(self.buffer):  # the shard fills up: write it
            room = len(self.buffer) - self.count
            self.buffer[self.count:] = ids[:room]
            self.count, ids = len(self.buffer), ids[room:]
            self.flush()
        self.buffer[self.count:self.count + len(ids)] = ids
        self.count += len(ids)

    def flush(self):
        """Write the buffer's tokens as shard `index`, in llm.c's format."""
        t0 = time.perf_counter()
        split = "val" if self.index == 0 else "train"
        header = np.zeros(tokenfile.LLMC_HEADER_BYTES // 4, dtype="<i4")
        header[:3] = tokenfile.LLMC_MAGIC, tokenfile.LLMC_VERSION, self.count
        with open(os.path.join(self.out_dir, f"corpus_{split}_{self.index:06d}.bin"), "wb") as f:
            f.write(header.tobytes())
            f.write(self.buffer[:self.count].tobytes())
        self.index, self.tokens, self.count = self.index + 1, self.tokens + self.count, 0
        self.write_s += time.perf_counter() - t0


def main(corpus, out_dir, num_proc, shard_tokens):
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.perf_counter()
    documents = datasets.load_dataset("json", data_files=corpus, split="train")
    t_load = time.perf_counter()
    writer = ShardWriter(out_dir, shard_tokens)
    with Pool(num_proc) as pool:
        for ids in pool.imap(tokenize, documents, chunksize=16):
            writer.add(ids)
    if writer.count:
        writer.flush()
    loop_s = time.perf_counter() - t_load
    print(json.dumps({"tokens": writer.tokens, "documents": len(documents), "shards": writer.index,
                      "load_s": t_load - t0, "tokenize_s": loop_s - writer.write_s,
                      "write_s": writer.write_s}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
