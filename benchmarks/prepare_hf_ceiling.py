"""The ceiling of the prepare benchmark's Hugging Face rows: the tokenizer's own batch encoding
(the tokenizers library's encode_batch_fast, on its own threads, one per core) in one process,
with nothing read, sent or written while it runs. prepare.py with the same tokenizer (its
worker processes, each encoding a chunk as one batch on one thread) is measured against it.

  python -m benchmarks.prepare_hf_ceiling CORPUS.jsonl TOKENIZER_FOLDER

Prints one JSON line: the tokens (an end-of-text after each document, as prepare.py writes),
and the seconds and CPU seconds (all threads) of encoding alone.
"""
import json
import sys
import time

from transformers import AutoTokenizer

BATCH_CHARS = 16 << 20  # a batch at a time: the whole corpus's encodings would not fit


def batches(texts):
    batch, size = [], 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def main(corpus, folder):
    t0 = time.perf_counter()
    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    backend = AutoTokenizer.from_pretrained(folder).backend_tokenizer
    backend.encode_special_tokens = True  # as prepare.py encodes: special strings are text
    t1, cpu = time.perf_counter(), time.process_time()
    tokens = sum(len(e.ids) + 1 for batch in batches(texts)
                 for e in backend.encode_batch_fast(batch, add_special_tokens=False))
    print(json.dumps({"tokens": tokens, "documents": len(texts), "load_s": t1 - t0,
                      "tokenize_s": time.perf_counter() - t1, "write_s": 0.0,
                      "tokenize_cpu_s": time.process_time() - cpu}))


if __name__ == "__main__":
    main(*sys.argv[1:])
