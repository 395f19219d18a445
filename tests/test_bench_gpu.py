"""bench.py's gpu part (tests/test_bench.py: what every part's run must show): its dry run,
every step on the CPU; without a GPU and without --small, every check recorded as not run; the
counting of torch.compile's recompiles and graph breaks in TORCH_LOGS's own lines. And the eval
part in its small mode."""
import json
import os
import re
import sys
import time
import types

import pytest
import torch

from benchmarks import common, gpu
from conftest import python
from test_bench import DOCS, bench_part, gpu_verdicts


@pytest.mark.slow
def test_gpu_dry_run(env, tmp_path):
    # every step of the GPU check on the CPU: its plumbing, and docs/bench left alone
    committed = os.path.join(DOCS, "bench", "gpu.json")
    with open(committed, "rb") as f:
        before = f.read()
    result, page = bench_part("gpu", env, tmp_path)
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
    assert re.search(r"^6 steps, loss [\d.]+ -> [\d.]+; ", checks["minimal loop"]["measured"])
    assert checks["sample.py"]["samples"] == 2
    assert "world size 2 on cpu, gloo" in checks["2 ranks"]["measured"]
    assert checks["modern + muon"]["recompiles_after"] == 0
    one_rank = checks[gpu.ONE_RANK]
    assert one_rank["evaluations"] == 4 and one_rank["memory_growth"] <= gpu.MEMORY_GROWTH
    assert "no process group (one rank), float32, sampling documents" in one_rank["measured"]
    # the network check's line, as the 2-rank runs log it (one host: within a node alone)
    assert checks["2 ranks"]["network"].startswith("network: bus bandwidth within a node ")
    # the one-rank group's backend as the process group says, not as the settings do
    collectives = checks["collectives, 1-rank group"]
    assert collectives["backend"] == "gloo" and "process group backend gloo (read from it), 1 " \
        "rank; ddp + muon (all-reduce, Muon's all_gather_single): loss " in collectives["measured"]
    assert all(r["took_s"] >= 0 for r in checks.values())
    assert checks["eval.py and HellaSwag"]["hellaswag_n"] == gpu.HELLASWAG_EXAMPLES
    fsdp_resumed, parity = checks["fsdp resumed, 2 ranks"], checks["ddp vs fsdp"]
    # float32 on a CPU: fsdp resumed from its folder repeats its run bit for bit, and its
    # losses are ddp's but for the order of the reductions
    assert fsdp_resumed["same_batches"] and fsdp_resumed["loss_rdiff"] == 0
    assert fsdp_resumed["profile"] == ["rank0_iters1-2.pt.trace.json",  # no CUDA: no snapshot
                                       "rank1_iters1-2.pt.trace.json"]
    assert fsdp_resumed["steps_compared"] == result["settings"]["rank_steps"] - \
        result["settings"]["rank_steps"] // 2
    # both with Muon in float32 (gpu.PARITY), as on the GPU
    assert parity["same_batches"] and parity["loss_rdiff"] < 1e-5 and \
        parity["grad_norm_rdiff"] < 1e-5
    assert "--optimizer=muon" in checks["fsdp, 2 ranks"]["measured"]
    assert [r["loop"] for r in result["speed"]] == list(gpu.LOOPS)
    assert "A dry run" in page and "python sample.py --out_dir=<ranks> --device=cpu" in page
    assert "python eval.py --out_dir=<ranks> --device=cpu" in page


def test_a_command_the_budget_cuts_short_is_not_run_not_failed(monkeypatch):
    # 3 s of budget left, a command of 30: cut by the budget, so "not run", as one not started
    monkeypatch.setattr(gpu, "MIN_START_S", 1)
    s = types.SimpleNamespace(deadline=time.monotonic() + 3, env=dict(os.environ))
    finished = gpu.launch(s, "sleeper", [sys.executable, "-c", "import time; time.sleep(30)"],
                          cap=60)
    assert finished is None and gpu.failed_row("sleeper", finished)["status"] == gpu.OUT_OF_TIME
    # its own cap (2 s, within the budget's 10) is its own fault: failed
    s.deadline = time.monotonic() + 10
    finished = gpu.launch(s, "sleeper", [sys.executable, "-c", "import time; time.sleep(30)"],
                          cap=2)
    assert gpu.failed_row("sleeper", finished)["result"] == "**fail**"


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
def test_eval(env, tmp_path):
    result, page = bench_part("eval", env, tmp_path)
    one, two, gpu = result["results"]
    assert (one["status"], two["status"], one["ranks"], two["ranks"]) == ("ok", "ok", 1, 2)
    assert (one["acc_norm_right"], one["acc_right"]) == (two["acc_norm_right"], two["acc_right"])
    for r in (one, two):
        assert r["seconds"] > 0 and r["examples_per_s"] > 0 and r["tokens_per_example"] > 8
        assert f"`{r['command']}`" in page
    assert gpu["status"].startswith("not run: no GPU")
