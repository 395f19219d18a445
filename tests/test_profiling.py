"""profile_steps as a user runs it: each rank's torch.profiler trace of the chosen iters, which
opens as JSON and holds their forward and backward, from a run whose losses and batches are an
unprofiled run's; and what a user sees for a window the run does not have, or a folder it cannot
make."""
import glob
import json

import pytest

from conftest import batches_and_losses, fails, torchrun, train_args

ARGS = ["--gradient_accumulation_steps=2", "--eval_interval=10", "--max_iters=5"]


@pytest.mark.slow
def test_two_ranks_write_a_trace_each_and_train_as_unprofiled(corpus, tmp_path, env):
    plain, profiled = tmp_path / "plain", tmp_path / "profiled"
    torchrun(2, "train.py", *train_args(corpus, plain, *ARGS), env=env)
    p = torchrun(2, "train.py", *train_args(corpus, profiled, *ARGS, "--profile_steps=2-3"),
                 env=env)
    assert f"profiled iters2-3: {profiled}/profile/rank*_iters2-3.pt.trace.json" in p.stdout + \
        p.stderr
    traces = sorted(glob.glob(f"{profiled}/profile/*"))
    assert [t.split("/")[-1] for t in traces] == ["rank0_iters2-3.pt.trace.json",
                                                 "rank1_iters2-3.pt.trace.json"]
    for trace in traces:
        with open(trace) as f:
            names = {e.get("name", "") for e in json.load(f)["traceEvents"]}
        assert {"aten::embedding", "aten::mm", "aten::scaled_dot_product_attention"} <= names
        assert any(n.startswith("autograd::engine::evaluate_function") for n in names)
    assert batches_and_losses(profiled) == batches_and_losses(plain)


@pytest.mark.parametrize("steps", ["3-1", "5", "2-9", "20-22", "a-b", "-1"])
def test_a_window_the_run_does_not_have(steps, corpus, tmp_path, env):
    p = fails("train.py", *train_args(corpus, tmp_path / "out", *ARGS, f"--profile_steps={steps}"),
              env=env)
    assert p.stderr.strip().splitlines()[-1] == (
        f"train.py: error: profile_steps={steps!r} is not a window of this run's steps: give "
        f"FIRST-LAST or one step, with FIRST <= LAST < max_iters=5 (iters 0 to 4), e.g. "
        f"profile_steps=20-22.")


def test_a_profile_folder_that_cannot_be_made(corpus, tmp_path, env):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "profile").write_text("a file of the user's")  # where the folder goes
    p = fails("train.py", *train_args(corpus, tmp_path / "out", *ARGS, "--profile_steps=1"),
              env=env)
    assert p.stderr.strip().splitlines()[-1] == (
        f"train.py: error: cannot make {tmp_path}/out/profile for profile_steps' traces (File "
        f"exists): make out_dir writable, or leave profile_steps out.")
    assert (tmp_path / "out" / "profile").read_text() == "a file of the user's"
