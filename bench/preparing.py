"""prepare.py's throughput and peak memory against the size of the corpus, and those of a
reference that tokenizes one document per call inside datasets.map (prepare_reference.py),
both from the same JSON-lines file with the GPT-2 tokenizer on the same number of processes."""
import json
import os
import shutil
import sys

import corpus
import tokenfile
import tokenizer
from bench import common, report
from bench.common import MiB

TITLE = "Prepare"
FULL = {"copies": [1, 3], "documents": None}
SMALL = {"copies": [1, 2], "documents": 100}  # the first 100 documents of the stdlib
SHARED_VOCAB = os.path.join(common.ROOT, "..", "shared", "tokenizers", "r50k_base.tiktoken")
TIME_CAP_S = 1800  # only stops a hung run
IMPLS = ("ddpgpt", "reference")  # as text/prepare.md names them
TABLES = {"table": [
    ("corpus", "pystdlib x{copies}"), ("documents", "{documents:,}"),
    ("size", "{corpus_bytes:size}"), ("pipeline", "{impl}"), ("tokens", "{tokens:,}"),
    ("wall s", "{wall_s:.1f}"), ("tokens/s", "{tok_per_s:,.0f}"),
    ("peak RSS", "{peak_rss:size}"), ("peak private", "{peak_private:size}"),
    ("reference's phases (load / tokenize / write s)",
     "{phases[load_s]:.1f} / {phases[tokenize_s]:.1f} / {phases[write_s]:.1f}"),
    ("load", "{load_1m}")]}


def tiktoken_env(workdir):
    """The environment that lets tiktoken load 'gpt2' with no network, and how it was made."""
    if os.environ.get("TIKTOKEN_CACHE_DIR"):
        return {}, f"TIKTOKEN_CACHE_DIR={os.environ['TIKTOKEN_CACHE_DIR']} (from the caller)"
    if not os.path.exists(SHARED_VOCAB):
        return {}, "tiktoken's own cache or download"
    tokenizer.install_tiktoken_file(SHARED_VOCAB, os.path.join(workdir, "tiktoken"))
    return {"TIKTOKEN_CACHE_DIR": os.path.join(workdir, "tiktoken")}, \
        "TIKTOKEN_CACHE_DIR set to a folder holding ../shared/tokenizers/r50k_base.tiktoken"


def stdlib_documents(limit):
    """The built-in corpus, as prepare.py --dataset=pystdlib reads it."""
    texts = corpus.open_source("pystdlib", None, 1)[2]()
    return [t for t in texts if t is not None and corpus.is_document(t)][:limit]


def write_corpus(path, documents, copies):
    """The documents `copies` times over, one JSON object per line: a file both sides read."""
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(copies):
            f.writelines(json.dumps({"text": text}) + "\n" for text in documents)
    return os.path.getsize(path)


def measure(impl, corpus, out_dir, env):
    cores = str(os.cpu_count())
    args = [sys.executable, "prepare.py", f"--dataset={corpus}", f"--out_dir={out_dir}",
            "--tokenizer=gpt2", f"--num_proc={cores}"] if impl == "ddpgpt" else \
        [sys.executable, "-m", "bench.prepare_reference", corpus, out_dir, cores]
    finished = common.check(common.run_watched(args, env, TIME_CAP_S),
                            f"the {impl} pipeline")
    if impl == "ddpgpt":
        phases = {}
        tokens = sum(s["tokens"] for s in tokenfile.read_meta(out_dir)["splits"].values())
    else:
        phases = json.loads(finished.output.strip().splitlines()[-1])
        tokens = phases.pop("tokens")
    return {"impl": impl, "tokens": tokens, "wall_s": finished.wall_s,
            "tok_per_s": tokens / finished.wall_s, "peak_rss": finished.peak_rss,
            "peak_private": finished.peak_private, "phases": phases,
            "load_1m": common.load_1m()}


def run(small, device, workdir):
    settings = SMALL if small else FULL
    extra, vocab_note = tiktoken_env(workdir)
    env = common.child_env(HF_DATASETS_CACHE=os.path.join(workdir, "hf"),
                           HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", **extra)
    documents, rows = stdlib_documents(settings["documents"]), []
    for copies in settings["copies"]:
        corpus = os.path.join(workdir, f"pystdlib-x{copies}.jsonl")
        corpus_bytes = write_corpus(corpus, documents, copies)
        for impl in IMPLS:
            print(f"bench prepare: pystdlib x{copies}, {impl}", file=sys.stderr)
            out_dir = os.path.join(workdir, f"{impl}-x{copies}")
            rows.append({"copies": copies, "documents": len(documents) * copies,
                         "corpus_bytes": corpus_bytes, **measure(impl, corpus, out_dir, env)})
            shutil.rmtree(out_dir)
        os.remove(corpus)
    return {"settings": {**settings, "processes": os.cpu_count(), "tokenizer": "gpt2",
                         "vocabulary": vocab_note},
            "results": rows, "targets": [target(rows)]}


def target(rows):
    parts, met = [], True
    for ours in (r for r in rows if r["impl"] == "ddpgpt"):
        ref = next(r for r in rows if r["impl"] == "reference" and r["copies"] == ours["copies"])
        met = met and ours["tok_per_s"] > ref["tok_per_s"]
        parts.append(f"x{ours['copies']}: {ours['tok_per_s']:,.0f} vs {ref['tok_per_s']:,.0f} "
                     f"tokens/s ({ours['tok_per_s'] / ref['tok_per_s']:.2f}x)")
    return {"target": "prepare.py faster than the per-document datasets.map reference",
            "measured": "; ".join(parts), "met": met}


def plot(result):
    return report.line_plot(
        result, f"Prepare, GPT-2 tokenizer, {result['settings']['processes']} processes",
        ("corpus_bytes", "corpus, MB of JSON lines", 1e6, "linear"),
        [("tok_per_s", "million tokens/s", 1e6, "linear"),
         ("peak_rss", "peak RSS, MiB (all processes)", MiB, "linear"),
         ("peak_private", "peak private memory, MiB (all processes)", MiB, "linear")],
        series=("impl",))
