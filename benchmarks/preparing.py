"""prepare.py's throughput and peak memory against the size of the corpus, and those of two
references: one that tokenizes one document per call inside datasets.map (prepare_reference.py,
nanoGPT's way) and llm.c's pipeline of one document per pool task, writing shards through a
preallocated buffer (prepare_llmc_reference.py). All read the same JSON-lines file and use the
GPT-2 tokenizer on the same number of processes; prepare.py and llm.c's both write shards.
preparing_hf.py measures a Hugging Face tokenizer with the same functions."""
import json
import os
import shutil
import subprocess
import sys

from ddpgpt import corpus, tokenfile, tokenizer
from benchmarks import common, report
from benchmarks.common import MiB

TITLE = "Prepare"
# shard_tokens: each corpus size makes two shards or more (x1 is 15M tokens in full, 0.8M small)
FULL = {"copies": [1, 3, 9], "documents": None, "shard_tokens": 10_000_000}
SMALL = {"copies": [1, 2], "documents": 100,  # the first 100 documents of the stdlib
         "shard_tokens": 200_000}
VOCAB = os.path.join(common.ROOT, "tests", "fixtures", "r50k_base.tiktoken")  # the tests' copy
TIME_CAP_S = 1800  # only stops a hung run
IMPLS = ("ddpgpt", "reference", "llmc")  # as text/prepare.md names them
CEILING = "hf-threads"  # preparing_hf.py's: encoding alone, its own clock, nothing written
TABLES = {"table": [
    ("corpus", "pystdlib x{copies}"), ("documents", "{documents:,}"),
    ("size", "{corpus_bytes:size}"), ("pipeline", "{impl}"), ("tokens", "{tokens:,}"),
    ("files", "{files}"), ("wall s", "{wall_s:.1f}"), ("tokens/s", "{tok_per_s:,.0f}"),
    ("CPU s", "{cpu_s:.1f}"), ("tokens per CPU s", "{tok_per_cpu_s:,.0f}"),
    ("peak RSS", "{peak_rss:size}"), ("peak private", "{peak_private:size}"),
    ("references' phases (load / tokenize / write s)",
     "{phases[load_s]:.1f} / {phases[tokenize_s]:.1f} / {phases[write_s]:.1f}"),
    ("load", "{load_1m}")]}


def tiktoken_env(workdir):
    """The environment that lets tiktoken load 'gpt2' with no network, and how it was made."""
    if os.environ.get("TIKTOKEN_CACHE_DIR"):
        return {}, f"TIKTOKEN_CACHE_DIR={os.environ['TIKTOKEN_CACHE_DIR']} (from the caller)"
    tokenizer.install_tiktoken_file(VOCAB, os.path.join(workdir, "tiktoken"))
    return {"TIKTOKEN_CACHE_DIR": os.path.join(workdir, "tiktoken")}, \
        "TIKTOKEN_CACHE_DIR set to a folder holding tests/fixtures/r50k_base.tiktoken"


def stdlib_documents(limit):
    """The built-in corpus, as prepare.py --dataset=pystdlib reads it."""
    texts = corpus.open_corpus("pystdlib", None, 1).documents()
    return [t for t in texts if t is not None and corpus.is_document(t)][:limit]


def write_corpus(path, documents, copies):
    """The documents `copies` times over, one JSON object per line: a file both sides read."""
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(copies):
            f.writelines(json.dumps({"text": text}) + "\n" for text in documents)
    return os.path.getsize(path)


def gpt2_as_hf(workdir, env):
    """A folder of GPT-2's vocabulary as a Hugging Face fast tokenizer, as export.py writes it."""
    folder = os.path.join(workdir, "gpt2-hf")
    subprocess.run([sys.executable, "-c", "import sys; from ddpgpt import hf; "
                    "hf.save_gpt2_tokenizer(sys.argv[1], 1024)", folder],
                   env=env, cwd=common.ROOT, check=True)
    return folder


def command(impl, corpus, out_dir, settings):
    cores = str(os.cpu_count())
    if impl in ("ddpgpt", "ddpgpt-hf"):
        vocabulary = "gpt2" if impl == "ddpgpt" else settings["hf"]
        return [sys.executable, "prepare.py", f"--dataset={corpus}", f"--out_dir={out_dir}",
                f"--tokenizer={vocabulary}", f"--num_proc={cores}",
                f"--shard_tokens={settings['shard_tokens']}"]
    if impl == CEILING:
        return [sys.executable, "-m", "benchmarks.prepare_hf_ceiling", corpus, settings["hf"]]
    if impl == "reference":
        return [sys.executable, "-m", "benchmarks.prepare_reference", corpus, out_dir, cores]
    return [sys.executable, "-m", "benchmarks.prepare_llmc_reference", corpus, out_dir, cores,
            str(settings["shard_tokens"])]


def written(impl, out_dir):
    """(tokens, files) of what a pipeline wrote, read back from its output: prepare.py's
    meta.json; the references' train.bin and val.bin, or llm.c's shards, through tokenfile,
    which checks each shard against its header."""
    if impl in ("ddpgpt", "ddpgpt-hf"):
        splits = tokenfile.read_meta(out_dir)["splits"].values()
        return sum(s["tokens"] for s in splits), sum(len(s["shards"]) for s in splits)
    splits = [tokenfile.open_split(out_dir, split, 1)
              for split in tokenfile.SPLITS]
    return sum(s.n_tokens for s in splits), sum(len(s.paths) for s in splits)


def measure(impl, corpus, out_dir, env, settings):
    finished = common.check(common.run_watched(command(impl, corpus, out_dir, settings), env,
                                               TIME_CAP_S), f"the {impl} pipeline")
    # the references print their phases as their last line
    phases = {} if impl.startswith("ddpgpt") else \
        json.loads(finished.output.strip().splitlines()[-1])
    if impl == CEILING:
        tokens, files = phases["tokens"], 0
        seconds, cpu_s = phases["tokenize_s"], phases.pop("tokenize_cpu_s")
    else:
        (tokens, files), seconds, cpu_s = written(impl, out_dir), finished.wall_s, finished.cpu_s
    if phases and phases.pop("tokens") != tokens:
        raise RuntimeError(f"the {impl} pipeline counted other tokens than it wrote")
    return {"impl": impl, "tokens": tokens, "files": files, "wall_s": seconds,
            "tok_per_s": tokens / seconds, "cpu_s": cpu_s,
            "tok_per_cpu_s": tokens / cpu_s, "peak_rss": finished.peak_rss,
            "peak_private": finished.peak_private, "phases": phases,
            "load_1m": common.load_1m()}


def run(small, device, workdir):
    rows, settings = measure_all(SMALL if small else FULL, IMPLS, workdir)
    return {"settings": settings, "results": rows, "targets": targets(rows)}


def measure_all(settings, impls, workdir):
    """(a row per corpus size and impl, the settings as the page shows them); preparing_hf.py's
    too."""
    extra, vocab_note = tiktoken_env(workdir)
    env = common.child_env(HF_DATASETS_CACHE=os.path.join(workdir, "hf"),
                           HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", **extra)
    folder = gpt2_as_hf(workdir, env) if CEILING in impls else None
    documents, rows = stdlib_documents(settings["documents"]), []
    for copies in settings["copies"]:
        corpus = os.path.join(workdir, f"pystdlib-x{copies}.jsonl")
        corpus_bytes = write_corpus(corpus, documents, copies)
        for impl in impls:
            print(f"bench prepare: pystdlib x{copies}, {impl}", file=sys.stderr)
            out_dir = os.path.join(workdir, f"{impl}-x{copies}")
            rows.append({"copies": copies, "documents": len(documents) * copies,
                         "corpus_bytes": corpus_bytes,
                         **measure(impl, corpus, out_dir, env, {**settings, "hf": folder})})
            shutil.rmtree(out_dir, ignore_errors=impl == CEILING)  # which writes none
        os.remove(corpus)
    return rows, {**settings, "processes": os.cpu_count(), "tokenizer": "gpt2",
                  "vocabulary": vocab_note}


def targets(rows):
    return [speed_target(rows, "reference", lambda ratio: ratio > 1,
                         "prepare.py faster than the per-document datasets.map reference"),
            speed_target(rows, "llmc", lambda ratio: ratio >= 2,
                         "prepare.py at least 2x the tokens/s of llm.c's pipeline (a pool task "
                         "per document, imap chunksize 16), at every corpus size"),
            memory_target(rows)]


def speed_target(rows, ref, met_at, target, impl="ddpgpt"):
    """prepare.py's tokens/s (impl's) against `ref`'s at each corpus size; met_at(ratio)
    judges one."""
    ratios = compared(rows, ref, impl)
    return {"target": target, "measured": "; ".join(text for text, _ in ratios),
            "met": all(met_at(ratio) for _, ratio in ratios)}


def compared(rows, ref, impl):
    """[(what it says, the ratio)] of impl's tokens/s against ref's at each corpus size."""
    out = []
    for ours in (r for r in rows if r["impl"] == impl):
        theirs = next(r for r in rows if r["impl"] == ref and r["copies"] == ours["copies"])
        ratio = ours["tok_per_s"] / theirs["tok_per_s"]
        out.append((f"x{ours['copies']}: {ours['tok_per_s']:,.0f} vs "
                    f"{theirs['tok_per_s']:,.0f} tokens/s ({ratio:.2f}x)", ratio))
    return out


def smallest_and_largest(rows, impl):
    """impl's rows at the smallest and the largest corpus."""
    ours = sorted((r for r in rows if r["impl"] == impl), key=lambda r: r["copies"])
    return ours[0], ours[-1]


def memory_target(rows, impl="ddpgpt"):
    """prepare.py's peak memory at the largest corpus within 10% of the smallest."""
    small, large = smallest_and_largest(rows, impl)
    parts, met = [], True
    for key, what in (("peak_rss", "peak RSS"), ("peak_private", "peak private")):
        change = large[key] / small[key] - 1
        met = met and change <= 0.10
        parts.append(f"{what} {report.size(large[key])} vs {report.size(small[key])} "
                     f"({change:+.0%})")
    which = "" if impl == "ddpgpt" else " with a Hugging Face fast tokenizer"  # preparing_hf's
    return {"target": f"prepare.py's peak memory{which} (RSS and private, all its processes) at "
                      f"pystdlib x{large['copies']} within 10% of x{small['copies']}",
            "measured": "; ".join(parts), "met": met}


def plot(result):
    return plot_titled(result,
                       f"Prepare, GPT-2 tokenizer, {result['settings']['processes']} processes")


def plot_titled(result, title):
    """The rows' speed and memory against the corpus size, a line per impl; preparing_hf.py's
    too."""
    return report.line_plot(
        result, title,
        ("corpus_bytes", "corpus, MB of JSON lines", 1e6, "linear"),
        [("tok_per_s", "million tokens/s", 1e6, "linear"),
         ("tok_per_cpu_s", "million tokens per CPU second", 1e6, "linear"),
         ("peak_rss", "peak RSS, MiB (all processes)", MiB, "linear"),
         ("peak_private", "peak private memory, MiB (all processes)", MiB, "linear")],
        series=("impl",))
