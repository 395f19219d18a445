"""parallel=fsdp under torchrun (gloo, CPU), as a user runs it: the same losses as ddp, sharded
checkpoint folders that resume exactly, on another world size and under ddp (and ddp's files
under fsdp), saves in the background that a kill or a full disk cannot turn into a newest
checkpoint that is not whole, export, eval and sample from a folder, and the bad combinations."""
import glob
import json
import logging
import os
import pickle
import re
import shutil
import time

import psutil
import pytest
import torch

from conftest import (ROOT, TINY, RunsCode, evals, fails, kill, process_tree, python,
                      ranks_command, resumed_from, rows_so_far, run, started, steps, torchrun,
                      torchrun_command, traceback_of_ours)
from ddpgpt import checkpoint
from ddpgpt.runtime import Ranks

RTOL = 1e-5  # ddp and fsdp sum the gradients over the ranks in other orders
ARGS = ["--gradient_accumulation_steps=4", "--max_iters=20", "--eval_interval=10",
        "--grad_clip=0.1"]  # 2 micro-steps per rank; a clip that clips


def train_args(corpus, out, *extra):
    return [f"--data_dir={corpus}", f"--out_dir={out}", *TINY, *ARGS, *extra]


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory, session_env):
    """{'ddp': out_dir, 'fsdp': out_dir} of the same 20 steps on 2 ranks, saving at 10 and 20."""
    root = tmp_path_factory.mktemp("runs")
    for kind in ("ddp", "fsdp"):
        torchrun(2, "train.py", *train_args(corpus, root / kind, f"--parallel={kind}"),
                 env=session_env)
    return {kind: str(root / kind) for kind in ("ddp", "fsdp")}


def relative_difference(a, b, key="loss"):
    """The largest relative difference of key between the steps of run b and the same steps
    of run a (the whole run, for a resumed b), which must have read the same batches."""
    a, b = steps(a), steps(b)
    assert b and set(b) <= set(a) and all(a[i]["batch_fp"] == b[i]["batch_fp"] for i in b)
    return max(abs(a[i][key] / b[i][key] - 1) for i in b)


def resumed(source, out, env, corpus, nproc, *extra):
    """The out_dir out of a run that resumes from a copy of source (a checkpoint at iter 10) to
    iter 20, on nproc ranks (conftest.resumed_from)."""
    return resumed_from(source, out, nproc, train_args(corpus, out, *extra), 10, env)


@pytest.mark.slow
def test_fsdp_trains_as_ddp_and_writes_each_ranks_part(runs, corpus, tmp_path, env):
    assert sorted(steps(runs["ddp"])) == sorted(steps(runs["fsdp"])) == list(range(20))
    assert relative_difference(runs["ddp"], runs["fsdp"]) <= RTOL
    assert relative_difference(runs["ddp"], runs["fsdp"], "grad_norm") <= RTOL
    for ev_ddp, ev_fsdp in zip(evals(runs["ddp"]), evals(runs["fsdp"])):
        assert ev_fsdp["val_loss"] == pytest.approx(ev_ddp["val_loss"], rel=RTOL)
    folder = checkpoint.path_for(runs["fsdp"], 20, folder=True)
    assert checkpoint.list_checkpoints(runs["fsdp"]) == [
        folder, checkpoint.path_for(runs["fsdp"], 10, folder=True)]
    assert sorted(os.listdir(folder)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "values.pt"]
    # each rank wrote its half of the weights and the optimizer's moments, about a half each
    parts = [os.path.getsize(os.path.join(folder, f"__{r}_0.distcp")) for r in (0, 1)]
    whole = os.path.getsize(checkpoint.path_for(runs["ddp"], 20))
    assert all(0.3 * whole < part < 0.7 * whole for part in parts), (parts, whole)
    # the other ways fsdp can reduce: with a reduce-scatter in every micro-step, and with the
    # blocks' weights kept gathered from forward to backward
    other = tmp_path / "other"
    torchrun(2, "train.py", *train_args(corpus, other, "--parallel=fsdp",
                                        "--reduce_every_micro_step=True",
                                        "--reshard_after_forward=False"), env=env)
    assert relative_difference(runs["ddp"], other) <= RTOL


@pytest.mark.slow
def test_fsdp_resumes_bit_for_bit_after_a_rank_is_killed(runs, corpus, tmp_path, env):
    """The run of runs['fsdp'] again, rank 1 killed once its checkpoint at 10 is written (the
    restart resumes from it): the same 20 steps, loss for loss."""
    killed = str(tmp_path / "killed")
    out = killing_rank_1(
        os.path.join(ROOT, "train.py"),
        train_args(corpus, killed, "--parallel=fsdp", "--log_interval=100", "--init_from=auto"),
        env, lambda: checkpoint.list_checkpoints(killed) and
        any(r.get("iter", -1) >= 11 for r in rows_so_far(killed)), tmp_path / "log")
    assert f"resuming from {checkpoint.path_for(killed, 10, folder=True)} (iter 10)" in out
    same = python("compare_runs.py", f"--out_dir={runs['fsdp']},{killed}", "--losses", env=env,
                  check=False)
    assert same.returncode == 0 and "over 20 steps" in same.stdout, same.stdout


def killing_rank_1(script, args, env, ready, log_path):
    """What script args printed on 2 ranks under torchrun with one restart, rank 1 killed
    (SIGKILL) once ready(): the restarted ranks must finish (exit 0)."""
    proc = started([*torchrun_command(2), "--max-restarts=1", script, *args],
                   dict(env, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"), log_path)
    wait_for(ready, proc)
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
               if os.path.basename(script) in " ".join(p.cmdline())]
    assert len(workers) == 2
    workers[1].kill()
    proc.wait(timeout=300)
    out = log_path.read_text()
    assert proc.returncode == 0, out
    return out


def wait_for(condition, proc, timeout=240):
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, "the run ended before it could be interrupted"
        assert time.time() < deadline, "what the test waits for never came"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_on_another_world_size(runs, corpus, tmp_path, env):
    """2 ranks wrote it; 4 read it (each a quarter of every tensor, DCP resharding), and one
    process reads it whole."""
    source = checkpoint.path_for(runs["fsdp"], 10, folder=True)
    for nproc, kind in ((4, "fsdp"), (1, "fsdp")):
        out = resumed(source, tmp_path / f"{nproc}", env, corpus, nproc, f"--parallel={kind}")
        assert relative_difference(runs["fsdp"], out) <= RTOL
        assert checkpoint.list_checkpoints(out)[0] == checkpoint.path_for(out, 20, folder=True)


@pytest.mark.slow
def test_ddp_and_fsdp_resume_each_others_checkpoints(runs, corpus, tmp_path, env):
    folder = checkpoint.path_for(runs["fsdp"], 10, folder=True)
    file = checkpoint.path_for(runs["ddp"], 10)
    under_ddp = resumed(folder, tmp_path / "ddp", env, corpus, 2, "--parallel=ddp")
    under_fsdp = resumed(file, tmp_path / "fsdp", env, corpus, 2, "--parallel=fsdp")
    assert relative_difference(runs["ddp"], under_ddp) <= RTOL
    assert relative_difference(runs["fsdp"], under_fsdp) <= RTOL
    # each wrote its own kind from there on; the one resumed from is not written again
    assert checkpoint.list_checkpoints(under_ddp) == [
        checkpoint.path_for(under_ddp, 20), checkpoint.path_for(under_ddp, 10, folder=True)]
    assert checkpoint.list_checkpoints(under_fsdp)[0] == checkpoint.path_for(under_fsdp, 20,
                                                                             folder=True)


def loaded(path):
    state, problem = checkpoint.read(path)
    assert problem is None, problem
    return state


def same_state(a, b):
    """Equal, tensor for tensor and value for value, but for the settings that made them
    differ (async_save) and where they are (out_dir)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a
                                            if k not in ("async_save", "out_dir"))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same_state, a, b))
    return a == b


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_save_in_the_background_writes_what_a_save_that_waits_writes(runs, kind, corpus,
                                                                       tmp_path, env):
    waited = tmp_path / "waited"
    torchrun(2, "train.py", *train_args(corpus, waited, f"--parallel={kind}",
                                        "--async_save=False"), env=env)
    for iter_num in (10, 20):
        a, b = (checkpoint.list_checkpoints(out)[20 // iter_num - 1]
                for out in (runs[kind], waited))
        assert os.path.basename(a) == os.path.basename(b)
        assert same_state(loaded(a), loaded(b)), iter_num
    assert loaded(a)["config"]["async_save"] and not loaded(b)["config"]["async_save"]


@pytest.mark.slow
@pytest.mark.parametrize("kind, nproc", [("ddp", 1), ("fsdp", 2)])
def test_a_run_killed_while_a_save_is_in_flight_resumes_from_the_one_before(
        runs, kind, nproc, corpus, tmp_path, env):
    """Each save takes 10 s more to publish (a slow file system), in the background: the run
    trains on meanwhile. Killed while the save at iter 10 is in flight, it resumes from the one
    before and repeats the uninterrupted run (on 2 ranks, runs['fsdp']: the evaluations, every
    5 steps here, change no step)."""
    out = str(tmp_path / "out")
    args = train_args(corpus, out, f"--parallel={kind}", "--eval_interval=5")
    launch = ranks_command(nproc)
    proc = started([*launch, os.path.join(ROOT, "tests", "launch_slow_save.py"), *args],
                   dict(env, SLOW_SAVE_S="10"), tmp_path / "log")
    try:
        # the save at 5 is published while the run goes on; the one at 10 is in flight
        wait_for(lambda: checkpoint.list_checkpoints(out) and
                 any(r.get("iter", -1) >= 13 for r in rows_so_far(out)), proc, timeout=300)
        in_flight = glob.glob(os.path.join(out, "ckpt_0000010*tmp"))
    finally:
        kill(process_tree(proc.pid))
        proc.wait()
    assert in_flight, "the save at 10 was not in flight when the run was killed"
    assert checkpoint.list_checkpoints(out) == [checkpoint.path_for(out, 5, folder=kind == "fsdp")]
    p = run([*launch, os.path.join(ROOT, "train.py"), *args, "--init_from=resume"], env)
    assert "resuming from " + checkpoint.path_for(out, 5, folder=kind == "fsdp") in p.stdout
    assert not glob.glob(os.path.join(out, "*tmp"))  # what the killed save left is gone
    if kind == "fsdp":
        whole = runs["fsdp"]
    else:
        whole = tmp_path / "whole"
        python("train.py", *train_args(corpus, whole, f"--parallel={kind}",
                                       "--eval_interval=5"), env=env)
    assert sorted(steps(out)) == list(range(20)) and relative_difference(whole, out) == 0


@pytest.mark.slow
def test_a_full_disk_during_a_sharded_save_is_a_clear_error_and_keeps_the_one_before(
        corpus, small_disk, env):
    out = os.path.join(small_disk, "out")
    os.makedirs(out)
    # one checkpoint folder fits, a second does not: the save at 6, in the background, fails
    p = torchrun(2, "train.py", *train_args(corpus, out, "--parallel=fsdp", "--max_iters=12",
                                            "--eval_interval=3"), env=env, check=False)
    assert p.returncode != 0 and "the disk is full" in p.stderr, p.stdout + p.stderr
    assert "could not write checkpoint " + checkpoint.path_for(out, 6, folder=True) in p.stderr
    assert not traceback_of_ours(p.stderr)
    assert not [f for f in os.listdir(out) if f.endswith("tmp")]
    assert checkpoint.list_checkpoints(out) == [checkpoint.path_for(out, 3, folder=True)]
    state, path = checkpoint.load_latest(out)
    assert path == checkpoint.path_for(out, 3, folder=True)


@pytest.mark.slow
def test_export_eval_and_sample_read_a_checkpoint_folder(runs, corpus, tmp_path, env):
    folder = checkpoint.path_for(runs["fsdp"], 20, folder=True)
    p = python("sample.py", f"--out_dir={runs['fsdp']}", "--start=def ", "--num_samples=1",
               "--max_new_tokens=20", env=env)
    assert p.stdout.startswith("def ") and f"{folder} (iter 20), tokenizer 'byte'" in p.stderr
    p = torchrun(2, "eval.py", f"--out_dir={folder}", f"--data_dir={corpus}",
                 "--hellaswag=False", "--eval_iters=4", "--batch_size=4", env=env)
    result = json.loads(p.stdout.splitlines()[-1])
    assert result["val_loss"] == pytest.approx(evals(runs["fsdp"])[-1]["val_loss"], rel=1e-6)
    python("export.py", f"--out_dir={runs['fsdp']}", f"--to={tmp_path / 'hf'}", env=env)
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    # one command makes the folder one file: the same values, and it resumes under ddp (on
    # one process: what the file holds is the point here; ddp on 2 ranks resuming a folder is
    # test_ddp_and_fsdp_resume_each_others_checkpoints)
    one_file = tmp_path / "ckpt_0000010.pt"
    python("export.py", f"--out_dir={checkpoint.path_for(runs['fsdp'], 10, folder=True)}",
           f"--to={one_file}", env=env)
    assert same_state(loaded(str(one_file)),
                      loaded(checkpoint.path_for(runs["fsdp"], 10, folder=True)))
    out = resumed(str(one_file), tmp_path / "out", env, corpus, 1)
    assert relative_difference(runs["fsdp"], out) <= RTOL


def test_a_damaged_or_dangerous_checkpoint_folder_is_passed_over(runs, tmp_path, caplog):
    out = str(tmp_path / "out")
    shutil.copytree(runs["fsdp"], out)
    newest, older = checkpoint.list_checkpoints(out)[:2]
    part = os.path.join(newest, "__1_0.distcp")
    os.truncate(part, os.path.getsize(part) // 2)
    caplog.set_level(logging.INFO, logger="ddpgpt")
    state, path = checkpoint.load_latest(out)
    assert path == older and state["iter_num"] == 10
    assert f"{newest} is incomplete: its file __1_0.distcp is" in caplog.messages[0]
    # an index that would run code when unpickled: refused, and nothing runs
    marker = tmp_path / "code_ran"
    with open(os.path.join(newest, ".metadata"), "wb") as f:
        pickle.dump(RunsCode(marker), f)
    caplog.clear()
    assert checkpoint.load_latest(out)[1] == older
    assert f"{newest} was refused: loading it would execute code (its index .metadata calls " \
           f"posix.system" in caplog.messages[0] and not marker.exists()
    os.remove(os.path.join(older, "values.pt"))
    caplog.clear()
    assert checkpoint.load_latest(out) == (None, None)
    assert f"{older} has no loadable values.pt" in caplog.messages[1]


@pytest.mark.slow
def test_compiled_blocks_train_as_the_eager_ones_and_compile_once_for_training(runs, corpus,
                                                                               tmp_path, env):
    """compile=True compiles each block in place; aot_eager (tests/launch_eager_compile.py)
    traces them and their backward as inductor would, without generating code. 3 evaluation
    batches over 2 ranks: every forward is still of batch_size windows, so the blocks compile
    once for the evaluations and once more for training (grad mode), never for a batch size."""
    out = tmp_path / "out"
    args = train_args(corpus, out, "--parallel=fsdp", "--compile=True", "--max_iters=6",
                      "--eval_interval=3", "--eval_iters=3")
    p = torchrun(2, "tests/launch_eager_compile.py", *args, env=dict(env, TORCH_LOGS="recompiles"))
    assert "compile = True" in p.stdout
    output = p.stdout + p.stderr
    assert "size mismatch" not in output
    recompiles = re.findall(r"\[rank(\d)\].*\[__recompiles\] Recompiling function", output)
    assert sorted(recompiles) == ["0", "1"], output  # each rank's first training step
    ran, eager = steps(out), steps(runs["fsdp"])
    assert sorted(ran) == list(range(6))
    for i in ran:
        assert ran[i]["loss"] == pytest.approx(eager[i]["loss"], rel=RTOL)
    assert sorted(os.listdir(checkpoint.path_for(out, 6, folder=True)))[0] == ".metadata"
    state = loaded(checkpoint.path_for(out, 6, folder=True))
    assert not [k for k in state["model"] if "_orig_mod" in k]


def swag(path):
    lines = [{"ctx": "def f(x):", "endings": [" return x", " import os", " pass", " x"],
              "label": 0},
             {"ctx": "Cats are", "endings": [" animals.", " numbers.", " blue.", " x"],
              "label": 0},
             {"ctx": "import", "endings": [" os", " the", " 12", " )"], "label": 0}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


@pytest.mark.slow
def test_evaluation_when_the_ranks_have_different_numbers_of_batches(corpus, tmp_path, env):
    """3 windows and 3 HellaSwag examples over 2 ranks: the rank with fewer batches still
    runs as many forwards (under fsdp each gathers the weights with the other rank)."""
    args = [f"--data_dir={corpus}", *TINY, "--batch_size=1", "--eval_iters=3",
            "--gradient_accumulation_steps=2", "--max_iters=2", "--eval_interval=2",
            "--hellaswag_interval=2", f"--hellaswag_path={swag(tmp_path / 'swag.jsonl')}",
            "--dist_timeout_s=120"]
    for kind in ("ddp", "fsdp"):
        torchrun(2, "train.py", *args, f"--out_dir={tmp_path / kind}", f"--parallel={kind}",
                 env=env)
    a, b = evals(tmp_path / "ddp"), evals(tmp_path / "fsdp")
    assert [r["iter"] for r in a] == [r["iter"] for r in b] == [0, 2]
    for ra, rb in zip(a, b):
        assert rb["val_loss"] == pytest.approx(ra["val_loss"], rel=RTOL)
        assert (rb["hellaswag_n"], rb["hellaswag_acc"]) == (ra["hellaswag_n"], ra["hellaswag_acc"])


@pytest.mark.parametrize("args, message", [
    (["--reshard_after_forward=False"], "reshard_after_forward=False is a setting of "
                                        "parallel='fsdp', and this run is parallel='ddp'"),
    (["--reduce_every_micro_step=True"], "reduce_every_micro_step=True is a setting of "
                                         "parallel='fsdp'"),
    (["--parallel=fsdp", "--dtype=float16"], "parallel='fsdp' does not train in float16 "
                                             "(dtype='float16')"),
    (["--parallel=zero3"], "parallel='zero3' is not one of 'ddp', 'fsdp'"),
])
def test_bad_combinations_are_clear_errors(env, args, message):
    assert message in fails("train.py", *args, env=env).stderr


def sharded_tiny():
    """A small GPT-2 as shard() shares it out, and a batch for it; in memplan.fake_ranks(2):
    rank 0 of 2 in torch's fake process group, whose collectives move nothing."""
    from ddpgpt import parallel
    from ddpgpt.model import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    parallel.shard(model, "cpu", "float32", reshard_after_forward=True, compile=False)
    return model, torch.zeros(2, 16, dtype=torch.long)


def test_the_roots_weights_stay_gathered_from_the_forward_into_the_backward():
    """FSDP2 keeps the root (the embeddings, tied to the output layer) gathered only at its
    default: the root was given reshard_after_forward, and its weights were gathered again at
    the start of every backward."""
    from torch.distributed.tensor import DTensor

    from ddpgpt import memplan
    with memplan.fake_ranks(2):
        model, x = sharded_tiny()
        _, loss = model(x, x)
        assert not isinstance(model.transformer.wte.weight, DTensor)  # gathered
        assert all(isinstance(p, DTensor) for p in model.transformer.h.parameters())
        loss.backward()
        assert all(isinstance(p, DTensor) for p in model.parameters())  # resharded


def test_a_micro_step_after_an_evaluation_reduces_no_gradients():
    """An evaluation's forward, which no backward follows, leaves the root gathered, and
    sync_gradients, which knew fsdp by its first weight's being a DTensor, missed it: the next
    step's first micro-step reduce-scattered its gradients, and a run resumed where it
    evaluates differed from the uninterrupted one in the last bits."""
    from ddpgpt import memplan, parallel
    with memplan.fake_ranks(2):
        model, x = sharded_tiny()
        with torch.no_grad():
            model(x, x)
        parallel.sync_gradients(model, False)
        model(x, x)[1].backward()
        assert all(p.grad is None for p in model.parameters())  # kept whole, unreduced


def test_a_save_in_the_background_needs_room_for_its_copy_in_host_memory():
    one = Ranks(0, 0, 1, 1)
    assert checkpoint.host_has_room(2**20, one)
    assert not checkpoint.host_has_room(2**50, one)  # a petabyte: the run saves synchronously
    # every rank of the host keeps its own copy
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f
                         if line.startswith("MemAvailable:"))
    assert checkpoint.host_has_room(available // 8, Ranks(0, 0, 2, 2))
    assert not checkpoint.host_has_room(available // 8, Ranks(0, 0, 8, 8))


@pytest.mark.slow
def test_nan_policy_skip_stops_every_rank_when_one_ranks_shard_is_not_finite(runs, corpus,
                                                                               tmp_path, env):
    """A NaN in the last row of one weight: under fsdp only rank 1 holds it. Every rank asks
    the others whether the weights are finite, so rank 0 gives up too, with the same error,
    instead of going on alone to find its peer gone."""
    out = tmp_path / "out"
    os.makedirs(out)
    state = torch.load(checkpoint.path_for(runs["ddp"], 10), weights_only=True)
    state["model"]["transformer.h.0.mlp.c_fc.weight"][-1, 0] = float("nan")
    torch.save(state, checkpoint.path_for(str(out), 10))
    p = fails("train.py", *train_args(corpus, out, "--parallel=fsdp", "--init_from=resume",
                                      "--nan_policy=skip"), env=env, nproc=2)
    assert "train.py: error (rank 0): nan_policy='skip' cannot recover at iter 10: the weights " \
           "themselves are no longer finite" in p.stderr, p.stdout + p.stderr


@pytest.mark.slow
def test_in_bfloat16_fsdp_keeps_the_residual_stream_in_bfloat16_and_trains_as_ddp(corpus,
                                                                                tmp_path, env):
    """arch=modern (rotary cos and sin, QK-norm) in bfloat16: ddp's autocast keeps the residual
    stream in float32, fsdp's gathered bfloat16 weights make it bfloat16 (docs/fsdp.md says
    why), and the losses agree to bfloat16's rounding. The QK-norm's gain, bfloat16 under fsdp,
    is computed in float32 with its input: no dtype mix for RMSNorm's fused kernel to refuse."""
    args = [*TINY, "--gradient_accumulation_steps=4", "--max_iters=4", "--eval_interval=4",
            "--eval_iters=2", "--dtype=bfloat16", "--arch=modern", f"--data_dir={corpus}"]
    seen = {}
    for kind in ("ddp", "fsdp"):
        p = torchrun(2, "tests/launch_block_dtypes.py", *args, f"--parallel={kind}",
                     f"--out_dir={tmp_path / kind}", env=env)
        seen[kind] = re.findall(r"block inputs \(rank \d\): (.*)", p.stdout)
        assert "Mismatch dtype" not in p.stderr, p.stderr
    assert seen == {"ddp": ["float32 float32 float32"] * 2,
                    "fsdp": ["bfloat16 bfloat16 bfloat16"] * 2}
    assert relative_difference(tmp_path / "ddp", tmp_path / "fsdp") <= 1e-3
