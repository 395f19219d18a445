"""The reference of the prepare benchmark, nanoGPT's way of tokenizing, written for this
comparison: load the corpus with the datasets library, split off validation documents, call
the tokenizer once per document inside Dataset.map(num_proc=...), then copy each split's ids
into its .bin file through a memmap, one shard of the dataset at a time.

  python -m benchmarks.prepare_reference CORPUS.jsonl OUT_DIR NUM_PROC

Prints one JSON line: the tokens written and the seconds each phase took.
"""
import json
import os
import sys
import time

import datasets
import numpy as np

from ddpgpt.tokenizer import get_tokenizer

_tokenizer = None  # one per worker process, made on its first document


def encode_document(example):
    global _tokenizer
    if _tokenizer is None:
        _tokenizer = get_tokenizer("gpt2")
    ids = _tokenizer.encode(example["text"])
    ids.append(_tokenizer.eot)
    return {"ids": ids, "len": len(ids)}


def write_split(split, path, shards=1024):
    n_tokens = int(np.sum(split.with_format("numpy")["len"]))
    out = np.memmap(path, dtype=np.uint16, mode="w+", shape=(n_tokens,))
    at = 0
    n_shards = min(shards, len(split))
    for i in range(n_shards):
        shard = split.shard(num_shards=n_shards, index=i, contiguous=True)
        ids = np.concatenate(list(shard.with_format("numpy")["ids"]))
        out[at:at + len(ids)] = ids
        at += len(ids)
    out.flush()
    return n_tokens


def main(corpus, out_dir, num_proc):
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.perf_counter()
    documents = datasets.load_dataset("json", data_files=corpus, split="train")
    t_load = time.perf_counter()
    parts = documents.train_test_split(test_size=0.0005, seed=2357, shuffle=True)
    tokenized = {name: parts[key].map(encode_document, remove_columns=["text"],
                                      num_proc=min(num_proc, len(parts[key])))
                 for name, key in (("train", "train"), ("val", "test"))}
    t_tokenize = time.perf_counter()
    tokens = sum(write_split(split, os.path.join(out_dir, f"{name}.bin"))
                 for name, split in tokenized.items())
    t_write = time.perf_counter()
    print(json.dumps({"tokens": tokens, "documents": len(documents), "load_s": t_load - t0,
                      "tokenize_s": t_tokenize - t_load, "write_s": t_write - t_tokenize}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
