"""bench.py in its small mode, as CI runs it: every part writes its JSON, plot and section of
the report, with numbers that make sense and verdicts that follow from them; the gpu part in its
dry run, every step on the CPU. Behaviour, not speed: no timing target has to be met. The
committed page is what its JSON gives. And the watchdog that caps the reference loaders: it
kills a command, and its children, at its memory or time cap; and the counting of torch.compile's
recompiles and graph breaks in TORCH_LOGS's own lines."""
import importlib.util
import json
import os
import re
import shutil
import sys

import numpy as np
import psutil
import pytest
import torch

from ddpgpt import tokenfile
from bench import common, datapath, gpu, recipe, report
from conftest import ROOT, python

DOCS = os.path.join(ROOT, "docs")
GROWTH_KEYS = ("startup_s", "rss_first", "private_first", "rss_after", "private_after")
SHARD_KEYS = ("startup_s", "rss_first", "rss_after")


def data_verdicts(result):
    """Each target's rule, restated: ddpgpt's start-up and memory at the largest file within
    10% of the smallest at every rank count; its p50 and p99 latency no worse than (a)'s; its
    start-up and RSS on the largest size as a shard set within 10% of it as one file. And
    where the run has the document index's rows (runs made since 'documents' mode): that
    mode's start-up and RSS at the largest file within 10% of the smallest, the index built at
    1 GB/s per core or more, every window of an epoch at a start, each start once."""
    rows = {(r["loader"], r["size"], r["files"], r["ranks"]): r for r in result["results"]}
    s = result["settings"]
    sizes, ranks, large = s["sizes"], s["ranks"], s["sizes"][-1]
    ours = {(size, n): rows["ddpgpt", size, 1, n] for size in sizes for n in ranks}
    growth = [all(ours[large, n][key] / ours[sizes[0], n][key] - 1 <= 0.10 for n in ranks)
              for key in GROWTH_KEYS]
    latency = [all(r[key] <= rows["nanogpt", size, 1, n][key] for (size, n), r in ours.items())
               for key in ("p50_ms", "p99_ms")]
    shards = [all(rows["ddpgpt", large, s["shards"], n][key] / ours[large, n][key] - 1 <= 0.10
                  for n in ranks) for key in SHARD_KEYS]
    if not result["index"]:
        return growth + latency + shards
    docs = {(size, n): rows["documents", size, 1, n] for size in sizes for n in ranks}
    documents = [all(docs[large, n][key] / docs[sizes[0], n][key] - 1 <= 0.10 for n in ranks)
                 for key in SHARD_KEYS]
    index = result["index"][0]
    return growth + latency + shards + documents + [
        index["gb_per_cpu_s"] >= 1, index["aligned"] == 1 and index["each_once"]]


def mix_verdicts(result):
    """Start-up with the mixture's sources within 10% of one source's, and p50 latency within
    1.5x of it, at every rank count."""
    rows = {(r["sources"], r["ranks"]): r for r in result["results"]}
    n, ranks = result["settings"]["sources"], result["settings"]["ranks"]
    return [all(rows[n, k]["startup_s"] / rows[1, k]["startup_s"] - 1 <= 0.10 for k in ranks),
            all(rows[n, k]["p50_ms"] <= 1.5 * rows[1, k]["p50_ms"] for k in ranks)]


def training_verdicts(result):
    """Data wait under 1% in every run; MFU is judged only on a GPU with a known peak."""
    done = [r for r in result["results"] if r["status"] == "ok"]
    gpu = next(r for r in result["results"] if r["gpu"])
    mfu = gpu["mfu"] >= 0.45 if gpu["status"] == "ok" and gpu["mfu"] is not None else None
    return [all(r["data_wait"] < 0.01 for r in done), mfu]


def prepare_verdicts(result):
    """prepare.py's tokens/s above the datasets.map reference's and at least twice llm.c's
    at every corpus size; its peak RSS and private memory at the largest corpus within 10% of
    the smallest."""
    rows = {(r["impl"], r["copies"]): r for r in result["results"]}
    copies = result["settings"]["copies"]
    ratios = {ref: [rows["ddpgpt", c]["tok_per_s"] / rows[ref, c]["tok_per_s"] for c in copies]
              for ref in ("reference", "llmc")}
    small, large = rows["ddpgpt", min(copies)], rows["ddpgpt", max(copies)]
    return [all(r > 1 for r in ratios["reference"]), all(r >= 2 for r in ratios["llmc"]),
            all(large[key] / small[key] - 1 <= 0.10 for key in ("peak_rss", "peak_private"))]


def prepare_hf_verdicts(result):
    """prepare.py with a Hugging Face tokenizer at least 0.9x the tokenizer's own batch
    encoding at every corpus size; its peak RSS and private memory flat within 10%."""
    rows = {(r["impl"], r["copies"]): r for r in result["results"]}
    copies = result["settings"]["copies"]
    small, large = rows["ddpgpt-hf", min(copies)], rows["ddpgpt-hf", max(copies)]
    return [all(rows["ddpgpt-hf", c]["tok_per_s"] >= 0.9 * rows["hf-threads", c]["tok_per_s"]
                for c in copies),
            all(large[key] / small[key] - 1 <= 0.10 for key in ("peak_rss", "peak_private"))]


def gpu_verdicts(result):
    """train.py within 3% of the minimal loop; 45% MFU where the peak is known; modern+muon's
    step within 10% of train.py's; no recompile after the first step where compiled; a resume
    with the same batches and losses within 0.1%; every check run and passed. Each None where
    what it judges did not run."""
    ours, ceiling, modern = result["speed"]
    checks = {r["check"]: r for r in result["results"]}
    ran = [r for r in result["results"] if r["status"] == "ok"]
    ceiling_met = ours["ms_per_step"] <= 1.03 * ceiling["ms_per_step"] \
        if ours["status"] == ceiling["status"] == "ok" else None
    mfu = ours["mfu"] >= 0.45 if ours["status"] == "ok" and ours["mfu"] is not None else None
    recipe_met = modern["ms_per_step"] <= 1.10 * ours["ms_per_step"] \
        if ours["status"] == modern["status"] == "ok" else None
    compiles = checks["recompiles"]
    recompiles = compiles["fresh_recompiles_after"] == compiles["resumed_recompiles_after"] == 0 \
        if compiles["status"] == "ok" and compiles["compiled"] else None
    resumed = checks["checkpoint and resume"]
    resume = resumed["same_batches"] and resumed["loss_rdiff"] <= 1e-3 \
        and resumed["steps_compared"] > 0 if resumed["status"] == "ok" else None
    every = len(ran) == len(result["results"]) and all(r["passed"] for r in ran) if ran else None
    return [ceiling_met, mfu, recipe_met, recompiles, resume, every]


def eval_verdicts(result):
    """For each model run on 1 and 2 ranks: the same counts on both; 2 ranks faster."""
    done = {(r["name"], r["ranks"]): r for r in result["results"] if r["status"] == "ok"}
    pairs = [(done[name, 1], done[name, 2]) for name, ranks in done
             if ranks == 1 and (name, 2) in done]
    return [all((one["acc_norm_right"], one["acc_right"]) == (two["acc_norm_right"],
                                                              two["acc_right"])
                for one, two in pairs),
            all(two["examples_per_s"] > one["examples_per_s"] for one, two in pairs)]


def recipe_verdicts(result):
    """From the runs' own curves: modern+muon and gpt2+muon reach gpt2+adamw's final val loss
    (of the same corpus and seed; linear between evaluations) within 0.4x and 0.7x its tokens,
    on every corpus and seed; modern+muon's train.py step within 10% of gpt2+adamw's;
    train.py's within 3% of the minimal loop's; its tokens/s no lower than nanoGPT's (None
    where nanoGPT did not run)."""
    runs = {(r["corpus"], r["combo"], r["seed"]): r for r in result["results"]}

    def share(corpus, combo, seed):
        base, run = runs[corpus, "gpt2+adamw", seed], runs[corpus, combo, seed]
        target = base["curve"][-1][1]
        points = run["curve"]
        for (t0, a), (t1, b) in zip([points[0]] + points, points):
            if b <= target:
                tokens = t1 if a == b else t0 + (t1 - t0) * (a - target) / (a - b)
                return tokens / (base["steps"] * base["tokens_per_step"])
        return None

    keys = {(corpus, seed) for corpus, _, seed in runs}
    shares = {combo: [share(c, combo, s) for c, s in keys] for combo in ("modern+muon",
                                                                         "gpt2+muon")}
    speed = {(r["loop"], r["combo"]): r for r in result["speed"]}
    base = speed["train.py", "gpt2+adamw"]["ms_per_step"]
    nanogpt = speed["nanoGPT", "gpt2+adamw"]
    return [all(x is not None and x <= 0.4 for x in shares["modern+muon"]),
            all(x is not None and x <= 0.7 for x in shares["gpt2+muon"]),
            speed["train.py", "modern+muon"]["ms_per_step"] <= 1.10 * base,
            base <= 1.03 * speed["minimal loop", "gpt2+adamw"]["ms_per_step"],
            base <= nanogpt["ms_per_step"] if nanogpt["status"] == "ok" else None]


def fsdp_verdicts(result):
    """At each rank count, fsdp's bytes per rank within 1.1 x ddp's / N plus the largest tensor
    it holds whole; its losses within 1e-5 of ddp's on the same batches; its resume exact; the
    step that starts a save in the background within 1.2x of a normal one, under ddp and
    fsdp; the background saves' checkpoints the same as the synchronous ones'."""
    rows = {(r["parallel"], r["ranks"]): r for r in result["results"]}
    losses, saves = result["settings"]["losses"], result["saves"]
    return [rows["fsdp", n]["total"] <= 1.1 * rows["ddp", n]["total"] / n +
            rows["fsdp", n]["largest_whole"] for n in sorted({n for _, n in rows})] + [
        losses["max_rdiff"] <= 1e-5 and losses["same_batches"],
        losses["resumed_exact"] and losses["resumed_steps"] > 0,
        *(next(r for r in saves if r["parallel"] == kind and r["async_save"])["ratio"] <= 1.2
          for kind in ("ddp", "fsdp")),
        all(result["settings"]["same_checkpoints"].values())]


def muon_verdicts(result):
    """Each model's most loaded rank within 1.1 x the total Newton-Schulz work / N plus its
    largest matrix's; the optimizer step's share of a ddp step at the most ranks not above
    its share at one; fsdp's bytes per rank within 1.1 x ddp's / N plus the largest tensor it
    holds whole; at each rank count, ddp within 1e-5 of one process and fsdp of ddp, on the
    same batches."""
    work, results = result["work"], result["results"]
    ddp = [r for r in results if r["parallel"] == "ddp"]
    sharded = next(r for r in results if r["parallel"] == "fsdp")
    whole = next(r for r in ddp if r["ranks"] == sharded["ranks"])
    return [all(w["most"] <= 1.1 * w["share"] + w["largest"] for w in work if w["model"] == m)
            for m in dict.fromkeys(w["model"] for w in work)] + [
        ddp[-1]["share"] <= ddp[0]["share"],
        sharded["total"] <= 1.1 * whole["total"] / sharded["ranks"] + sharded["largest_whole"],
        *(row["ddp_vs_one"] <= 1e-5 and row["fsdp_vs_ddp"] <= 1e-5 and row["same_batches"]
          for row in result["losses"])]


def recompute_verdicts(result):
    """full's activations, at the peak and the blocks', at most a third of none's;
    selective's between the two, both ways."""
    rows = {r["mode"]: r for r in result["results"]}
    act, blocks = ({m: r[key] for m, r in rows.items()} for key in ("activations", "blocks"))
    return [rows["full"]["share"] <= 1 / 3, rows["full"]["blocks_share"] <= 1 / 3,
            all(x["full"] < x["selective"] < x["none"] for x in (act, blocks))]


def documents_verdicts(result):
    """None: the part measures what documents mode does to the loss, and sets no target."""
    return []


def memplan_verdicts(result):
    """The plan's peak within 10% of the measured one in every configuration."""
    return [all(abs(r["planned"] / r["measured"] - 1) <= 0.10 for r in result["results"])]


VERDICTS = {"data": data_verdicts, "mix": mix_verdicts, "training": training_verdicts,
            "prepare": prepare_verdicts, "prepare_hf": prepare_hf_verdicts, "gpu": gpu_verdicts,
            "eval": eval_verdicts, "documents": documents_verdicts, "fsdp": fsdp_verdicts,
            "muon": muon_verdicts, "recipe": recipe_verdicts, "recompute": recompute_verdicts,
            "memplan": memplan_verdicts}


def bench_part(part, env, tmp_path, flag="--small", timeout=600):
    out = tmp_path / "bench"
    python("bench.py", part, flag, f"--out_dir={out}", env=env, timeout=timeout)
    with open(out / f"{part}.json") as f:
        result = json.load(f)
    assert (out / f"{part}.png").stat().st_size > 0
    page = (out / "benchmarks.md").read_text()
    assert f"Command: `python bench.py {part} {flag} --out_dir={out}`" in page
    assert [t["met"] for t in result["targets"]] == VERDICTS[part](result)
    for t in result["targets"]:
        assert t["measured"] and f"{report.verdict(t['met'])}: {t['target']}." in page
    assert result["machine"]["cores"] >= 1 and result["machine"]["torch"]
    assert isinstance(result["load_1m_start"], float)
    return result, page


@pytest.mark.slow
def test_data_path(env, tmp_path):
    result, page = bench_part("data", env, tmp_path)
    s = result["settings"]
    rows = {(r["size"], r["files"], r["ranks"], r["loader"]): r for r in result["results"]}
    assert len(rows) == len(result["results"])
    large, n_shards = max(s["sizes"]), s["shards"]
    assert set(rows) == {(size, 1, ranks, loader) for size in s["sizes"] for ranks in s["ranks"]
                         for loader in ("ddpgpt", "documents", "nanogpt", "seed")} | \
        {(large, n_shards, ranks, "ddpgpt") for ranks in s["ranks"]}
    for (size, files, ranks, loader), r in rows.items():
        if loader == "seed" and size == max(s["sizes"]):
            # a sample index per token, permuted in every rank: past a cap at 64 MiB (memory,
            # or time on a loaded machine, whichever it reaches first)
            assert r["status"].startswith(("exceeded the memory cap", "exceeded the time cap")), r
            continue
        assert r["status"] == "ok", r
        assert r["files_read"] == files  # the shard set was read as a shard set
        assert r["startup_s"] > r["setup_s"] > 0
        assert 0 < r["p50_ms"] <= r["p99_ms"] and r["batches_per_s"] > 0
        for when in ("first", "after"):
            assert 0 < r[f"private_{when}"] < r[f"rss_{when}"]
    assert "| 1 | 64 MiB | 1 | seed | exceeded the " in page
    assert "| 1 | 64 MiB | 1,000 | ddpgpt | " in page and "| 1 | 64 MiB | 1 | documents | " in page
    assert len(result["targets"]) == 15
    # the document index of a real token file: its documents, and every window of an epoch of
    # 'documents' mode at a start the bench found in the tokens itself, each start once
    index, = result["index"]
    assert index["size"] == s["index_size"] and index["windows"] > index["documents"] > 1000
    assert index["aligned"] == 1 and index["each_once"] and index["build_cpu_s"] > 0
    assert f"| {report.size(s['index_size'])} | {index['documents']:,} | " in page


@pytest.mark.slow
def test_mix(env, tmp_path):
    result, page = bench_part("mix", env, tmp_path)
    s = result["settings"]
    rows = {(r["sources"], r["ranks"]): r for r in result["results"]}
    assert len(rows) == len(result["results"]) == 2 * len(s["ranks"])
    assert set(rows) == {(n, k) for n in (1, s["sources"]) for k in s["ranks"]}
    assert s["sources"] == len(s["weights"]) == 8
    for (n, ranks), r in rows.items():
        assert r["status"] == "ok", r
        assert r["files_read"] == n and r["size"] == s["size"]  # every source was opened
        assert r["startup_s"] > r["setup_s"] > 0
        assert 0 < r["p50_ms"] <= r["p99_ms"] and r["batches_per_s"] > 0
    assert "| 2 | 8 | 8 | " in page
    assert len(result["targets"]) == 2


@pytest.mark.slow
def test_training(env, tmp_path):
    result, page = bench_part("training", env, tmp_path)
    quick, gpu = result["results"]
    assert quick["status"] == "ok" and quick["device"] == "cpu"
    assert quick["steps_counted"] == quick["steps"] - quick["warmup"]
    assert quick["ms_per_step"] > 0 and quick["tok_per_s"] > 0 and quick["tflops"] > 0
    assert 0 <= quick["data_wait"] <= quick["data_wait_max"] < 1
    assert quick["mfu"] is None  # a CPU has no known peak
    assert gpu["status"].startswith("not run: no GPU")
    assert f"`{quick['command']}`" in page
    # the quick-start run's curves, by plot.py, on the page
    assert (tmp_path / "bench" / "training-curves.png").stat().st_size > 0
    assert "![Training: the runs' curves](training-curves.png)" in page


@pytest.mark.slow
def test_prepare(env, tmp_path):
    result, _ = bench_part("prepare", env, tmp_path)
    rows = {(r["copies"], r["impl"]): r for r in result["results"]}
    copies, shard_tokens = result["settings"]["copies"], result["settings"]["shard_tokens"]
    impls = ("ddpgpt", "reference", "llmc")
    assert set(rows) == {(c, impl) for c in copies for impl in impls}
    for c in copies:
        # the same documents through the same tokenizer: the same number of tokens
        tokens = rows[c, "ddpgpt"]["tokens"]
        assert tokens == rows[c, "reference"]["tokens"] == rows[c, "llmc"]["tokens"] > 0
        assert tokens == c * rows[copies[0], "ddpgpt"]["tokens"]
        for impl in impls:
            r = rows[c, impl]
            assert r["tok_per_s"] > 0 and r["peak_rss"] > 0
            # the CPU time of the command and its workers, which no more cores can exceed
            assert 0 < r["cpu_s"] <= r["wall_s"] * result["machine"]["cores"] + 0.5
        # shards: llm.c's fill each one to shard_tokens; prepare.py's end at a document's end
        assert rows[c, "llmc"]["files"] == -(-tokens // shard_tokens) >= 2
        assert rows[c, "ddpgpt"]["files"] > 2 and rows[c, "reference"]["files"] == 2
    phases = {"documents", "load_s", "tokenize_s", "write_s"}
    assert set(rows[copies[0], "reference"]["phases"]) == phases
    assert set(rows[copies[0], "llmc"]["phases"]) == phases | {"shards"}


@pytest.mark.slow
def test_prepare_hf(env, tmp_path):
    result, _ = bench_part("prepare_hf", env, tmp_path)
    rows = {(r["copies"], r["impl"]): r for r in result["results"]}
    copies = result["settings"]["copies"]
    assert set(rows) == {(c, impl) for c in copies for impl in ("ddpgpt", "ddpgpt-hf",
                                                                 "hf-threads")}
    for c in copies:
        # GPT-2's vocabulary, tiktoken's and Hugging Face's: the same tokens, the same shards
        assert rows[c, "ddpgpt"]["tokens"] == rows[c, "ddpgpt-hf"]["tokens"] == \
            rows[c, "hf-threads"]["tokens"] == c * rows[copies[0], "ddpgpt"]["tokens"] > 0
        assert rows[c, "ddpgpt"]["files"] == rows[c, "ddpgpt-hf"]["files"] >= 2
        assert rows[c, "hf-threads"]["files"] == 0
        for r in (rows[c, impl] for impl in ("ddpgpt", "ddpgpt-hf", "hf-threads")):
            assert r["tok_per_s"] > 0 and r["peak_rss"] > 0
            assert 0 < r["cpu_s"] <= r["wall_s"] * result["machine"]["cores"] + 0.5


@pytest.mark.slow
def test_documents(env, tmp_path):
    result, page = bench_part("documents", env, tmp_path)
    runs = {(r["corpus"], r["mode"], r["seed"]): r for r in result["results"]}
    seeds = result["settings"]["seeds"]
    assert set(runs) == {(c, m, s) for c in ("quick start", "functions")
                         for m in ("epoch", "documents") for s in seeds}
    for r in runs.values():
        assert r["status"] == "ok" and r["steps"] == result["settings"]["steps"]
        assert all(np.isfinite(r[k]) and r[k] > 0 for k in ("train_loss", "val_loss",
                                                             "val_loss_docs"))
    for d in result["differences"]:  # documents' number less epoch's, at equal tokens
        epoch, docs = (runs[d["corpus"], mode, d["seed"]] for mode in ("epoch", "documents"))
        assert epoch["tokens"] == docs["tokens"] > 0
        assert d["val_loss_docs"] == docs["val_loss_docs"] - epoch["val_loss_docs"]
    corpora = {c["corpus"]: c for c in result["corpora"]}
    for c in corpora.values():  # every document starts a window; a long one, more
        assert c["windows"] >= c["documents"] > 1 and 0 < c["first_share"] <= 1
    assert corpora["functions"]["mean_length"] < corpora["quick start"]["mean_length"]
    assert "| quick start | documents | " in page and "val_loss_docs: documents - epoch" in page


def test_shard_set_is_the_token_space_of_one_file(tmp_path):
    # the data part's shard set against its single file: as many tokens, in shards of sizes
    # that differ by one token at most, which the loader reads through meta.json
    size, n_shards = 2 * 7003, 7
    one = datapath.sparse_token_file(str(tmp_path / "one"), size)
    many = datapath.sparse_shard_set(str(tmp_path / "many"), size, n_shards)
    single, shards = (tokenfile.open_split(d, "train", 16) for d in (one, many))
    assert single.n_tokens == shards.n_tokens == size // 2 and len(shards.paths) == n_shards
    assert set(np.diff(shards.starts).tolist()) == {1000, 1001}


@pytest.mark.slow
def test_gpu_dry_run(env, tmp_path):
    # every step of the GPU check on the CPU: its plumbing, and docs/bench left alone
    committed = os.path.join(DOCS, "bench", "gpu.json")
    with open(committed, "rb") as f:
        before = f.read()
    result, page = bench_part("gpu", env, tmp_path, flag="--dry-run")
    with open(committed, "rb") as f:
        assert f.read() == before
    assert result["settings"]["mode"] == "dry run"
    checks = {r["check"]: r for r in result["results"]}
    assert list(checks) == gpu.CHECKS
    for name, r in checks.items():
        assert r["status"] == "ok" and r["passed"], r
        assert f"| {name} | pass | {r['measured']} |" in page
    for r in result["speed"]:
        assert r["status"] == "ok" and r["ms_per_step"] > 0 and r["tok_per_s"] > 0, r
        assert r["steps_counted"] == result["settings"]["steps"] - result["settings"]["warmup"]
        assert r["mfu"] is None and r["peak_mem"] is None  # a CPU: no peak, no CUDA allocator
    assert 0 <= result["speed"][0]["data_wait"] < 1
    resumed = checks["checkpoint and resume"]
    # on a CPU in float32 a resumed run repeats the uninterrupted one bit for bit
    assert resumed["same_batches"] and resumed["loss_rdiff"] == 0 and resumed["save_s"] >= 0
    assert resumed["steps_compared"] == result["settings"]["steps"] - result["settings"]["save_at"]
    compiles = checks["recompiles"]
    assert not compiles["compiled"]
    assert [compiles[f"{run}_{key}"] for run in ("fresh", "resumed")
            for key in ("recompiles_first_step", "recompiles_after", "graph_breaks")] == [0] * 6
    assert checks["sample.py"]["samples"] == 2
    assert "world size 2 on cpu, gloo" in checks["2 ranks"]["measured"]
    assert checks["modern + muon"]["recompiles_after"] == 0
    assert [r["loop"] for r in result["speed"]] == list(gpu.LOOPS)
    assert "A dry run" in page and "python sample.py --out_dir=<ranks> --device=cpu" in page


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU it would run the checks")
def test_gpu_part_without_a_gpu_records_not_run(env, tmp_path):
    out = tmp_path / "bench"
    python("bench.py", "gpu", f"--out_dir={out}", env=env)
    with open(out / "gpu.json") as f:
        result = json.load(f)
    assert result["settings"]["mode"] == "not run"
    assert all(r["status"] == gpu.NO_GPU for r in result["results"] + result["speed"])
    assert [t["met"] for t in result["targets"]] == gpu_verdicts(result) == [None] * 6
    assert f"| versions | {gpu.NO_GPU} |" in (out / "benchmarks.md").read_text()


def load_bench_cli():
    # bench.py by its path: the name `bench` is the package of its parts
    spec = importlib.util.spec_from_file_location("bench_cli", os.path.join(ROOT, "bench.py"))
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


def test_every_part_is_all_but_gpu_without_a_gpu():
    # so that a CPU run of every part never replaces a GPU run's results with "not run"
    cli = load_bench_cli()
    every = list(cli.PARTS) if torch.cuda.is_available() else ["data", "mix", "training",
                                                                "prepare", "prepare_hf", "eval",
                                                                "documents", "fsdp", "muon",
                                                                "recipe", "recompute", "memplan"]
    assert cli.parse_args([]).parts == every
    assert cli.parse_args(["--small"]).parts == list(cli.PARTS)
    assert cli.parse_args(["gpu"]).parts == ["gpu"]
    dry = cli.parse_args(["gpu", "--dry-run"])
    assert dry.small and dry.out_dir == os.path.join(ROOT, "out-bench-small")


# a tiny compiled module run as train.py runs its model: evaluated, then trained; and after the
# first step's line, called with another shape, which must show as a recompile after it
COMPILED = """
import torch
class M(torch.nn.Module):
    def forward(self, x):
        x = x + 1 if self.training else x - 1
        torch._dynamo.graph_break()
        return x * 2
m = torch.compile(M(), backend="eager")  # dynamo's own work, no code generation: fast
with torch.no_grad():
    m.eval()(torch.ones(3))
m.train()(torch.ones(3))
print("iter 0: loss 1.0000, lr 1e-4", flush=True)
m(torch.ones(5))
"""


@pytest.mark.slow
def test_compile_events_are_counted_in_torch_logs_own_lines(env):
    finished = common.run_watched([sys.executable, "-c", COMPILED],
                                  {**env, "TORCH_LOGS": gpu.TORCH_LOGS}, 300)
    assert finished.returncode == 0, finished.output
    first, after, breaks = gpu.compile_events(finished.output)
    assert first >= 1 and after >= 1 and breaks >= 1, finished.output


def test_compile_events_before_and_after_the_first_step():
    line = "V1130 12:00:00.000000 1 torch/_dynamo/{}] [0/{}] [__{}] {}"
    output = "\n".join([
        line.format("guards.py:1", 0, "graph_breaks", "Graph break in user code at m.py:6"),
        line.format("guards.py:1", 0, "graph_breaks", "Graph Break Reason: a call"),
        "iter 0: train loss 5.0000, val loss 5.0000",  # an evaluation, not a step
        line.format("guards.py:2", 1, "recompiles", "Recompiling function forward in m.py:3"),
        line.format("guards.py:2", 1, "recompiles", "    triggered by the following guard"),
        "iter 0: loss 5.0000, lr 1.00e-04, 10.0 ms, 100 tok/s, data wait 0.1%",
        line.format("guards.py:2", 2, "recompiles", "Recompiling function forward in m.py:3"),
        "iter 1: loss 5.0000, lr 1.00e-04, 10.0 ms, 100 tok/s, data wait 0.1%"])
    assert gpu.compile_events(output) == (1, 1, 1)
    assert gpu.compile_events("iter 0: loss 1.0") == (0, 0, 0)


@pytest.mark.slow
def test_recipe(env, tmp_path):
    env.pop("NANOGPT_DIR", None)  # nanoGPT's row: not run, and said so
    result, page = bench_part("recipe", env, tmp_path)
    runs = {(r["corpus"], r["combo"], r["seed"]): r for r in result["results"]}
    assert set(runs) == {(corpus, f"{arch}+{optimizer}", seed)
                         for corpus, c in result["settings"]["corpora"].items()
                         for seed in c["seeds"] for arch in ("gpt2", "modern")
                         for optimizer in ("adamw", "muon")}
    for r in runs.values():
        tokens = [t for t, _ in r["curve"]]
        assert tokens[0] == 0 and tokens[-1] == r["steps"] * r["tokens_per_step"]
        assert all(loss > 0 for _, loss in r["curve"]) and r["final_val_loss"] == r["curve"][-1][1]
    for corpus in result["settings"]["corpora"]:
        # the same data and the same first batch's loss for the same arch and seed: only the
        # optimizer differs, and it has not stepped yet at iter 0
        for arch in ("gpt2", "modern"):
            first = {runs[corpus, f"{arch}+{o}", 1]["curve"][0][1] for o in ("adamw", "muon")}
            assert len(first) == 1, first
    reach = {(r["corpus"], r["combo"]): r for r in result["reach"]}
    for (corpus, combo), r in reach.items():
        seeds = result["settings"]["corpora"][corpus]["seeds"]
        assert r["seeds"] == len(seeds) == len(r["ratios"])
        if combo == "gpt2+adamw":  # its own final loss is reached at its last evaluation
            assert r["ratios"] == [1.0] * len(seeds)
    speed = {(r["loop"], r["combo"]): r for r in result["speed"]}
    # the small mode times train.py for the two combinations the targets compare
    assert set(speed) == {(loop, c) for loop in ("train.py", "minimal loop")
                          for c in ("gpt2+adamw", "modern+muon")} | {("nanoGPT", "gpt2+adamw")}
    assert speed["nanoGPT", "gpt2+adamw"]["status"] == recipe.NO_NANOGPT
    for r in speed.values():
        assert r["status"] != "ok" or r["ms_per_step"] > 0 and r["tok_per_s"] > 0
    assert "| pystdlib-gpt2 | modern+muon | 1 |" in page and "| minimal loop | gpt2+adamw |" in page


def test_recipe_tokens_to_reach_a_loss():
    curve = [[0, 5.0], [100, 3.0], [200, 2.0], [300, 2.5]]
    assert recipe.tokens_to_reach(curve, 2.5) == 150
    assert recipe.tokens_to_reach(curve, 2.0) == 200
    assert recipe.tokens_to_reach(curve, 6.0) == 0
    assert recipe.tokens_to_reach(curve, 1.9) is None


@pytest.mark.slow
def test_eval(env, tmp_path):
    result, page = bench_part("eval", env, tmp_path)
    one, two, gpu = result["results"]
    assert (one["status"], two["status"], one["ranks"], two["ranks"]) == ("ok", "ok", 1, 2)
    assert (one["acc_norm_right"], one["acc_right"]) == (two["acc_norm_right"], two["acc_right"])
    for r in (one, two):
        assert r["seconds"] > 0 and r["examples_per_s"] > 0 and r["tokens_per_example"] > 8
        assert f"`{r['command']}`" in page
    assert gpu["status"].startswith("not run: no GPU")


@pytest.mark.slow
def test_fsdp(env, tmp_path):
    result, page = bench_part("fsdp", env, tmp_path, timeout=1800)  # 9 launches of torchrun
    rows = {(r["parallel"], r["ranks"]): r for r in result["results"]}
    ranks = result["settings"]["ranks"]  # 2 in the small mode; 2 and 4 in the full one
    assert set(rows) == {(kind, n) for kind in ("ddp", "fsdp") for n in ranks}
    for n in ranks:
        ddp, fsdp = rows["ddp", n], rows["fsdp", n]
        assert ddp["params"] == fsdp["params"] > 0
        # ddp: 4 + 4 + 8 bytes a parameter on every rank; fsdp: a 1/N share of them, but for
        # AdamW's step counts, which every rank keeps whole (4 bytes each)
        assert ddp["weights"] == ddp["grads"] == 4 * ddp["params"] and ddp["per_param"] > 16
        assert fsdp["total"] == pytest.approx(ddp["total"] / n, rel=0.01)
        assert fsdp["largest_whole"] == 4 and ddp["largest_whole"] > 4
        assert 0 < fsdp["peak_rss"] and 0 < ddp["peak_rss"]
    assert 16 <= result["settings"]["per_param"] < 16.1
    assert len(result["saves"]) == 4 and all(r["ratio"] > 0 for r in result["saves"])
    assert result["settings"]["same_checkpoints"] == {"ddp": True, "fsdp": True}
    losses = result["settings"]["losses"]
    assert losses["same_batches"] and losses["resumed_exact"] and losses["resumed_steps"] == 3
    fits = result["fits"]
    assert [f["params"] for f in fits] == sorted(f["params"] for f in fits)
    assert all(f["fsdp"] < f["fsdp_accumulating"] and f["fsdp"] < f["ddp"] for f in fits)
    assert fits[0]["params"] == 124_373_760  # GPT-2 124M: no biases, 50304 token ids
    assert [row["gpu"] for row in result["settings"]["largest"]] == ["8 x 24 GB", "8 x 40 GB",
                                                                    "8 x 80 GB"]
    assert "| 8 x 80 GB |" in page


@pytest.mark.slow
def test_muon(env, tmp_path):
    result, page = bench_part("muon", env, tmp_path, timeout=1800)  # 6 launches of torchrun
    work = {(w["model"], w["ranks"]): w for w in result["work"]}
    for model in ("quick start (modern)", "GPT-2 124M"):
        # one rank does all of the work; N ranks about 1/N each, counted from the owners
        assert work[model, 1]["most"] == work[model, 1]["share"]
        for n in (2, 4, 8):
            assert work[model, n]["most"] == pytest.approx(work[model, 1]["most"] / n, rel=0.05)
    assert work["GPT-2 124M", 1]["matrices"] == 48  # 4 in each of the 12 blocks
    assert "| GPT-2 124M | 8 |" in page
    rows = {(r["parallel"], r["ranks"]): r for r in result["results"]}
    assert set(rows) == {("ddp", 1), ("ddp", 2), ("fsdp", 2)}
    # ddp: every byte on every rank; fsdp: half of them, Muon's momentum too, but for
    # AdamW's step counts, which every rank keeps whole
    assert rows["ddp", 1]["total"] == rows["ddp", 2]["total"]
    assert rows["fsdp", 2]["total"] == pytest.approx(rows["ddp", 2]["total"] / 2, rel=0.01)
    assert all(0 < r["optimizer_ms"] < r["step_ms"] for r in rows.values())
    assert [row["ranks"] for row in result["losses"]] == [2]
    assert result["losses"][0]["same_batches"]


@pytest.mark.slow
def test_recompute(env, tmp_path):
    result, page = bench_part("recompute", env, tmp_path)  # 3 processes of a tiny model
    rows = {r["mode"]: r for r in result["results"]}
    assert list(rows) == ["none", "selective", "full"]
    assert rows["none"]["share"] == rows["none"]["slowdown"] == 1
    for r in rows.values():
        assert 0 < r["activations"] < r["total"] and r["step_s"] > 0
    assert "| full |" in page


@pytest.mark.parametrize("part", VERDICTS)
def test_committed_verdicts_follow_from_their_numbers(part):
    with open(os.path.join(DOCS, "bench", f"{part}.json")) as f:
        result = json.load(f)
    assert [t["met"] for t in result["targets"]] == VERDICTS[part](result)


def test_report_only_gives_back_the_committed_page(env, tmp_path):
    # the page is a function of the JSON: rewritten from the JSON alone, it is the same page
    shutil.copytree(os.path.join(DOCS, "bench"), tmp_path / "bench")
    python("bench.py", "--report_only", f"--out_dir={tmp_path / 'bench'}",
           f"--report={tmp_path / 'benchmarks.md'}", env=env)
    with open(os.path.join(DOCS, "benchmarks.md")) as f:
        assert (tmp_path / "benchmarks.md").read_text() == f.read(), \
            "docs/benchmarks.md is stale: run `python bench.py --report_only`"


def test_unknown_part_is_an_error(env):
    p = python("bench.py", "dat", env=env, check=False)
    assert p.returncode == 2 and "unknown part(s) dat" in p.stderr


def test_memory_cap_kills_the_command():
    hog = "import time; x = b'x' * (512 * 2**20); time.sleep(60)"
    finished = common.run_watched([sys.executable, "-c", hog], common.child_env(), 60,
                                  mem_cap=128 * common.MiB)
    assert finished.exceeded.startswith("memory cap 128 MiB after")
    assert finished.returncode != 0 and finished.wall_s < 30
    assert finished.peak_private > 128 * common.MiB


def test_time_cap_kills_children_in_their_own_session():
    # as torchrun starts its ranks: each in a new session, out of reach of a process-group kill
    parent = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
              "'import time; time.sleep(60)'], start_new_session=True); print(p.pid, "
              "flush=True); time.sleep(60)")
    finished = common.run_watched([sys.executable, "-c", parent], common.child_env(), 2)
    assert finished.exceeded == "time cap 2 s" and finished.wall_s < 30
    child = int(finished.output.split()[0])
    try:
        assert psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        pass


@pytest.mark.parametrize("n_bytes, text", [(512, "512 B"), (1536, "1.5 KiB"),
                                           (16 * 2**20, "16 MiB"), (16 * 2**30, "16 GiB")])
def test_sizes_read_as_people_write_them(n_bytes, text):
    assert report.size(n_bytes) == text


@pytest.mark.slow
def test_memplan(env, tmp_path):
    result, page = bench_part("memplan", env, tmp_path)
    assert [(r["parallel"], r["ranks"]) for r in result["results"]] == [("ddp", 1)]
    assert all(r["planned"] > 0 and r["measured"] > 0 for r in result["results"])
    [tiny] = result["fits"]
    assert 0 < tiny["fsdp_one"] < tiny["ddp_one"]
    assert re.fullmatch(r"ddp, batch_size <= \d+; fsdp, batch_size <= \d+", tiny["gpu_24"])
    assert "| 8 x 24 GiB |" in page
