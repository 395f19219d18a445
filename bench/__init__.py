"""The benchmark behind the project's claims, run by bench.py at the repository root.

  datapath.py         start-up, memory and batch latency against the size of train.bin and the
                      number of ranks, for data.py and two reference loaders
  datapath_rank.py    one rank of that benchmark, launched by torchrun
  training.py         train.py's tokens/s, ms/step, data wait and MFU, from its metrics.jsonl
  preparing.py        prepare.py's tokens/s and peak memory against corpus size, and a reference
  prepare_reference.py  that reference: a per-document tokenizer inside datasets.map
  report.py           docs/benchmarks.md, generated from the JSON of every part
  common.py           machine description, watched subprocesses, statistics
"""
