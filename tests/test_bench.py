"""bench.py in its small mode, as CI runs it: every part writes its JSON, plot and section of
the report, with numbers that make sense. Behaviour, not speed: no timing target is checked.
And the watchdog that caps the reference loaders: it kills a command, and its children, at
its memory or time cap."""
import json
import sys

import psutil
import pytest

from bench import common, report
from conftest import python


def bench_part(part, env, tmp_path):
    out = tmp_path / "bench"
    python("bench.py", part, "--small", f"--out_dir={out}", env=env)
    with open(out / f"{part}.json") as f:
        result = json.load(f)
    assert (out / f"{part}.png").stat().st_size > 0
    report = (out / "benchmarks.md").read_text()
    assert f"Command: `python bench.py {part} --small --out_dir={out}`" in report
    for t in result["targets"]:
        assert t["met"] in (True, False, None) and t["measured"]
        assert t["target"] in report
    assert result["machine"]["cores"] >= 1 and result["machine"]["torch"]
    assert isinstance(result["load_1m_start"], float)
    return result, report


def test_data_path(env, tmp_path):
    result, report = bench_part("data", env, tmp_path)
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
    assert "| 2 | 64 MiB | seed | exceeded the memory cap" in report
    assert len(result["targets"]) == 7


def test_training(env, tmp_path):
    result, report_text = bench_part("training", env, tmp_path)
    quick, gpu = result["results"]
    assert quick["status"] == "ok" and quick["device"] == "cpu"
    assert quick["steps_counted"] == quick["steps"] - quick["warmup"]
    assert quick["ms_per_step"] > 0 and quick["tok_per_s"] > 0 and quick["tflops"] > 0
    assert 0 <= quick["data_wait"] <= quick["data_wait_max"] < 1
    assert quick["mfu"] is None  # a CPU has no known peak
    assert gpu["status"].startswith("not run: no GPU")
    assert result["targets"][1]["met"] is None
    # the page is a function of the JSON: rewriting it from the JSON alone gives it back
    page = tmp_path / "bench" / "benchmarks.md"
    page.unlink()
    python("bench.py", "--report_only", f"--out_dir={tmp_path / 'bench'}", env=env)
    assert page.read_text() == report_text


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
