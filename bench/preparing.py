"""prepare.py's throughput and peak memory against the size of the corpus, and those of a
reference that tokenizes one document per call inside datasets.map (prepare_reference.py),
both from the same JSON-lines file with the GPT-2 tokenizer on the same number of processes."""
import json
import os
import shutil
import sys
import sysconfig

import tokenfile
import prepare
from bench import common, report

TITLE = "Prepare"
FULL = {"copies": [1, 3], "documents": None}
SMALL = {"copies": [1, 2], "documents": 100}  # the first 100 documents of the stdlib
SHARED_VOCAB = os.path.join(common.ROOT, "..", "shared", "tokenizers", "r50k_base.tiktoken")
TIKTOKEN_CACHE_KEY = "0ea1e91bbb3a60f729a8dc8f777fd2fc07cd8df4"  # tiktoken's name for it
TIME_CAP_S = 1800  # only stops a hung run
IMPLS = {"ddpgpt": "prepare.py", "reference": "datasets.map, a document per call"}


def tiktoken_env(workdir):
    """The environment that lets tiktoken load 'gpt2' with no network, and how it was made."""
    if os.environ.get("TIKTOKEN_CACHE_DIR"):
        return {}, f"TIKTOKEN_CACHE_DIR={os.environ['TIKTOKEN_CACHE_DIR']} (from the caller)"
    if not os.path.exists(SHARED_VOCAB):
        return {}, "tiktoken's own cache or download"
    cache = os.path.join(workdir, "tiktoken")
    os.makedirs(cache, exist_ok=True)
    shutil.copy(SHARED_VOCAB, os.path.join(cache, TIKTOKEN_CACHE_KEY))
    return {"TIKTOKEN_CACHE_DIR": cache}, ("TIKTOKEN_CACHE_DIR set to a folder holding "
                                           "../shared/tokenizers/r50k_base.tiktoken")


def stdlib_documents(limit):
    """The built-in corpus, as prepare.py --dataset=pystdlib reads it."""
    root = sysconfig.get_paths()["stdlib"]
    texts = (prepare.python_source(path) for path in prepare.stdlib_files(root))
    documents = [t for t in texts if t is not None and prepare.is_document(t)]
    return documents[:limit] if limit else documents


def write_corpus(path, documents, copies):
    """The documents `copies` times over, one JSON object per line: a file both sides read."""
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(copies):
            for text in documents:
                f.write(json.dumps({"text": text}) + "\n")
    return os.path.getsize(path)


def measure(impl, corpus, out_dir, env):
    cores = str(os.cpu_count())
    args = [sys.executable, "prepare.py", f"--dataset={corpus}", f"--out_dir={out_dir}",
            "--tokenizer=gpt2", f"--num_proc={cores}"] if impl == "ddpgpt" else \
        [sys.executable, "-m", "bench.prepare_reference", corpus, out_dir, cores]
    finished = common.check(common.run_watched(args, env, TIME_CAP_S), IMPLS[impl])
    if impl == "ddpgpt":
        tokens, phases = sum(s["tokens"] for s in tokenfile.read_meta(out_dir)["splits"].values()), {}
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
    documents = stdlib_documents(settings["documents"])
    rows = []
    for copies in settings["copies"]:
        corpus = os.path.join(workdir, f"pystdlib-x{copies}.jsonl")
        corpus_bytes = write_corpus(corpus, documents, copies)
        for impl in IMPLS:
            print(f"bench prepare: pystdlib x{copies}, {impl}", file=sys.stderr)
            out_dir = os.path.join(workdir, f"{impl}-x{copies}")
            rows.append({"copies": copies, "documents": len(documents) * copies,
                         "corpus_bytes": corpus_bytes,
                         **measure(impl, corpus, out_dir, env)})
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


def markdown(result):
    s = result["settings"]
    head = ["corpus", "documents", "size", "pipeline", "tokens", "wall s", "tokens/s",
            "peak RSS", "peak private", "reference's phases (load / tokenize / write s)", "load"]
    body = [[f"pystdlib x{r['copies']}", f"{r['documents']:,}", report.size(r["corpus_bytes"]),
             IMPLS[r["impl"]], f"{r['tokens']:,}", f"{r['wall_s']:.1f}",
             f"{r['tok_per_s']:,.0f}", report.size(r["peak_rss"]),
             report.size(r["peak_private"]),
             " / ".join(f"{r['phases'][k]:.1f}" for k in ("load_s", "tokenize_s", "write_s"))
             if r["phases"] else "", r["load_1m"]] for r in result["results"]]
    return [f"The corpus is the Python standard library's source (what `prepare.py "
            f"--dataset=pystdlib` reads), one document per file, written as JSON lines and "
            f"repeated for the larger sizes, so that both pipelines read the same file. Both use "
            f"the {s['tokenizer']} tokenizer on {s['processes']} processes (the vocabulary: "
            f"{s['vocabulary']}). Wall time is from the command's start to its exit; memory is "
            f"sampled every 50 ms and summed over the process and its workers (pages shared "
            f"after a fork count once per process). The reference writes its Arrow cache in a "
            f"fresh folder, so nothing is cached between runs.", "",
            *report.table(head, body)]


def plot(result, path):
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for impl, color in (("ddpgpt", "C0"), ("reference", "C1")):
        rows = [r for r in result["results"] if r["impl"] == impl]
        mb = [r["corpus_bytes"] / 1e6 for r in rows]
        left.plot(mb, [r["tok_per_s"] / 1e6 for r in rows], "o-", color=color,
                  label=IMPLS[impl])
        right.plot(mb, [r["peak_rss"] / 2**20 for r in rows], "o-", color=color,
                   label=f"{IMPLS[impl]}, RSS")
        right.plot(mb, [r["peak_private"] / 2**20 for r in rows], "o--", color=color,
                   label=f"{IMPLS[impl]}, private")
    left.set_ylabel("million tokens/s")
    right.set_ylabel("peak memory, MiB (all processes)")
    for ax in (left, right):
        ax.set_xlabel("corpus, MB of JSON lines")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Prepare, GPT-2 tokenizer, {result['settings']['processes']} processes")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
