"""bench.py in its small mode, as CI runs it: every part writes its JSON, plot and section of
the report, with numbers that make sense and verdicts that follow from them. Behaviour, not
speed: no timing target has to be met. The committed page is what its JSON gives. And the
watchdog that caps the reference loaders: it kills a command, and its children, at its memory
or time cap."""
import json
import os
import shutil
import sys

import psutil
import pytest

from bench import common, report
from conftest import ROOT, python

DOCS = os.path.join(ROOT, "docs")
GROWTH_KEYS = ("startup_s", "rss_first", "private_first", "rss_after", "private_after")


def data_verdicts(result):
    """Each target's rule, restated: ddpgpt's start-up and memory at the largest file within
    10% of the smallest at every rank count; its p50 and p99 latency no worse than (a)'s."""
    rows = {(r["loader"], r["size"], r["ranks"]): r for r in result["results"]}
    sizes, ranks = result["settings"]["sizes"], result["settings"]["ranks"]
    ours = {(size, n): rows["ddpgpt", size, n] for size in sizes for n in ranks}
    growth = [all(ours[sizes[-1], n][key] / ours[sizes[0], n][key] - 1 <= 0.10 for n in ranks)
              for key in GROWTH_KEYS]
    latency = [all(r[key] <= rows["nanogpt", size, n][key] for (size, n), r in ours.items())
               for key in ("p50_ms", "p99_ms")]
    return growth + latency


def training_verdicts(result):
    """Data wait under 1% in every run; MFU is judged only on a GPU with a known peak."""
    done = [r for r in result["results"] if r["status"] == "ok"]
    gpu = next(r for r in result["results"] if r["gpu"])
    mfu = gpu["mfu"] >= 0.45 if gpu["status"] == "ok" and gpu["mfu"] is not None else None
    return [all(r["data_wait"] < 0.01 for r in done), mfu]


def prepare_verdicts(result):
    """prepare.py's tokens/s above the reference's at every corpus size."""
    rows = {(r["impl"], r["copies"]): r for r in result["results"]}
    return [all(rows["ddpgpt", c]["tok_per_s"] > rows["reference", c]["tok_per_s"]
                for c in result["settings"]["copies"])]


def eval_verdicts(result):
    """For each model run on 1 and 2 ranks: the same counts on both; 2 ranks faster."""
    done = {(r["name"], r["ranks"]): r for r in result["results"] if r["status"] == "ok"}
    pairs = [(done[name, 1], done[name, 2]) for name, ranks in done
             if ranks == 1 and (name, 2) in done]
    return [all((one["acc_norm_right"], one["acc_right"]) == (two["acc_norm_right"],
                                                              two["acc_right"])
                for one, two in pairs),
            all(two["examples_per_s"] > one["examples_per_s"] for one, two in pairs)]


VERDICTS = {"data": data_verdicts, "training": training_verdicts, "prepare": prepare_verdicts,
            "eval": eval_verdicts}


def bench_part(part, env, tmp_path):
    out = tmp_path / "bench"
    python("bench.py", part, "--small", f"--out_dir={out}", env=env)
    with open(out / f"{part}.json") as f:
        result = json.load(f)
    assert (out / f"{part}.png").stat().st_size > 0
    page = (out / "benchmarks.md").read_text()
    assert f"Command: `python bench.py {part} --small --out_dir={out}`" in page
    assert [t["met"] for t in result["targets"]] == VERDICTS[part](result)
    for t in result["targets"]:
        assert t["measured"] and f"{report.verdict(t['met'])}: {t['target']}." in page
    assert result["machine"]["cores"] >= 1 and result["machine"]["torch"]
    assert isinstance(result["load_1m_start"], float)
    return result, page


def test_data_path(env, tmp_path):
    result, page = bench_part("data", env, tmp_path)
    s = result["settings"]
    rows = {(r["size"], r["ranks"], r["loader"]): r for r in result["results"]}
    assert set(rows) == {(size, ranks, loader) for size in s["sizes"] for ranks in s["ranks"]
                         for loader in ("ddpgpt", "nanogpt", "seed")}
    for (size, ranks, loader), r in rows.items():
        if loader == "seed" and size == max(s["sizes"]):
            # a sample index per token, permuted in every rank: past a cap at 64 MiB (memory,
            # or time on a loaded machine, whichever it reaches first)
            assert r["status"].startswith(("exceeded the memory cap", "exceeded the time cap")), r
            continue
        assert r["status"] == "ok", r
        assert r["startup_s"] > r["setup_s"] > 0
        assert 0 < r["p50_ms"] <= r["p99_ms"] and r["batches_per_s"] > 0
        for when in ("first", "after"):
            assert 0 < r[f"private_{when}"] < r[f"rss_{when}"]
    assert "| 2 | 64 MiB | seed | exceeded the " in page
    assert len(result["targets"]) == 7


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


def test_prepare(env, tmp_path):
    result, _ = bench_part("prepare", env, tmp_path)
    rows = {(r["copies"], r["impl"]): r for r in result["results"]}
    copies = result["settings"]["copies"]
    assert set(rows) == {(c, impl) for c in copies for impl in ("ddpgpt", "reference")}
    for c in copies:
        # the same documents through the same tokenizer: the same number of tokens
        assert rows[c, "ddpgpt"]["tokens"] == rows[c, "reference"]["tokens"] > 0
        assert rows[c, "ddpgpt"]["tokens"] == c * rows[copies[0], "ddpgpt"]["tokens"]
        for impl in ("ddpgpt", "reference"):
            assert rows[c, impl]["tok_per_s"] > 0 and rows[c, impl]["peak_rss"] > 0
    assert set(rows[copies[0], "reference"]["phases"]) == {"documents", "load_s",
                                                            "tokenize_s", "write_s"}


def test_eval(env, tmp_path):
    result, page = bench_part("eval", env, tmp_path)
    one, two, gpu = result["results"]
    assert (one["status"], two["status"], one["ranks"], two["ranks"]) == ("ok", "ok", 1, 2)
    assert (one["acc_norm_right"], one["acc_right"]) == (two["acc_norm_right"], two["acc_right"])
    for r in (one, two):
        assert r["seconds"] > 0 and r["examples_per_s"] > 0 and r["tokens_per_example"] > 8
        assert f"`{r['command']}`" in page
    assert gpu["status"].startswith("not run: no GPU")


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
