"""train.py under torchrun (gloo, CPU), as a user runs it: training, exact resume,
configuration errors."""
import contextlib
import glob
import json
import logging
import os
import shutil

import pytest
import torch

from conftest import TINY, batches_and_losses, evals, fails, metrics, python, steps, torchrun
from ddpgpt import launch, parallel, runtime
from test_sample import PASSIVE
from ddpgpt.errors import UserError
from ddpgpt.runtime import Ranks


# 2 micro-steps of 4 per rank on 2 ranks (1 on 4), and dropout: what a resume must repeat
# exactly, the gradients accumulated without a reduction and the dropout's random numbers
RESUMABLE = [*TINY, "--gradient_accumulation_steps=4", "--dropout=0.1"]
TWO_RANK_RUN = [*RESUMABLE, "--max_iters=40", "--eval_interval=20", "--log_interval=10"]


@pytest.fixture(scope="module")
def two_rank_run(corpus, tmp_path_factory, session_env):
    """(out_dir, CompletedProcess) of 40 steps on 2 ranks, evaluated and saved at 20 and 40:
    trained once, read by the tests of training, of eval_only and of an exact resume on 2
    ranks (from a copy of its checkpoint at 20)."""
    out = tmp_path_factory.mktemp("two_ranks") / "out"
    p = torchrun(2, "train.py", f"--data_dir={corpus}", f"--out_dir={out}", *TWO_RANK_RUN,
                 env=session_env)
    return out, p


@pytest.mark.slow
def test_two_ranks_train_save_and_the_loss_falls(two_rank_run):
    out, p = two_rank_run
    assert "world size 2" in p.stdout and \
        "(gradient_accumulation_steps=4 / world size 2 = 2 micro-steps of 4 per rank)" in p.stdout
    rows = steps(out)
    assert sorted(rows) == list(range(40))
    first, last = rows[0]["loss"], sum(rows[i]["loss"] for i in range(35, 40)) / 5
    assert last < first - 1.0, (first, last)
    rows = evals(out)
    assert [r["iter"] for r in rows] == [0, 20, 40]
    assert rows[-1]["val_loss"] < rows[0]["val_loss"] - 1.0
    assert sorted(os.listdir(out)) == ["ckpt_0000020.pt", "ckpt_0000040.pt", "metrics.jsonl"]
    assert p.stdout.count("iter 10: loss") == 1  # printed once, by rank 0


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])  # with 4, a sum's rounding depends on DDP's buckets
def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(ranks, env, corpus, tmp_path, request):
    """The second half, resumed from a copy of the whole run's checkpoint at its midpoint,
    repeats the whole run's steps and its last evaluation. On 2 ranks the whole run is
    two_rank_run (40 steps, resumed from 20); on 4, one of 12 steps (resumed from 6)."""
    if ranks == 2:
        whole, _ = request.getfixturevalue("two_rank_run")
        args, middle, end = [f"--data_dir={corpus}", *TWO_RANK_RUN], 20, 40
    else:
        whole, middle, end = tmp_path / "whole", 6, 12
        args = [f"--data_dir={corpus}", *RESUMABLE, "--eval_interval=6", "--max_iters=12"]
        torchrun(ranks, "train.py", *args, f"--out_dir={whole}", env=env)
    half = tmp_path / "half"
    half.mkdir()
    ckpt = f"ckpt_{middle:07d}.pt"
    shutil.copy(whole / ckpt, half / ckpt)
    p = torchrun(ranks, "train.py", *args, f"--out_dir={half}", "--init_from=resume", env=env)
    assert "resuming from" in p.stdout and ckpt in p.stdout
    a, b = steps(whole), steps(half)
    assert sorted(a) == list(range(end)) and sorted(b) == list(range(middle, end))
    assert batches_and_losses(whole, b) == batches_and_losses(half)
    assert evals(whole)[-1] == evals(half)[-1] and evals(whole)[-1]["iter"] == end


@pytest.mark.slow
def test_eval_only_reports_the_same_losses_on_any_world_size(two_rank_run, env, corpus, tmp_path):
    """The 2-rank run's last evaluation, and eval_only on 1 process of a copy of its last
    checkpoint."""
    trained, _ = two_rank_run
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(trained / "ckpt_0000040.pt", out / "ckpt_0000040.pt")
    at_two = evals(trained)[-1]
    python("train.py", "config/eval_owt.py", f"--data_dir={corpus}", f"--out_dir={out}", *TINY,
           "--eval_iters=4", "--gradient_accumulation_steps=4", "--dropout=0.1", env=env)
    at_one = evals(out)[-1]
    assert at_one["iter"] == at_two["iter"] == 40
    assert at_one["val_loss"] == pytest.approx(at_two["val_loss"], rel=1e-6)


@pytest.fixture(scope="module")
def wandb_run(corpus, tmp_path_factory, session_env):
    """A folder holding out/, a 2-step run on 1 process logged to wandb (offline), and the
    wandb/ folder that wandb wrote: trained once, read by the tests of wandb and of a resume
    with another architecture."""
    root = tmp_path_factory.mktemp("wandb_run")
    python("train.py", f"--data_dir={corpus}", f"--out_dir={root / 'out'}", *TINY,
           "--gradient_accumulation_steps=1", "--max_iters=2", "--eval_interval=2",
           "--wandb_log=True", "--wandb_run_name=test",
           env=dict(session_env, WANDB_DIR=str(root)), cwd=str(root))
    return root


@pytest.mark.slow
def test_wandb_logs_offline_what_metrics_jsonl_logs(wandb_run):
    (run_file,) = glob.glob(str(wandb_run / "wandb" / "offline-run-*" / "run-*.wandb"))
    with open(run_file, "rb") as f:
        logged = f.read()  # protobuf records: each key and each value's JSON appear as bytes
    # the start row is the file's alone
    rows = [r for r in metrics(wandb_run / "out") if "run" not in r]
    assert len(rows) == 4  # evaluation at 0, steps 0 and 1, evaluation at 2
    for row in rows:
        for key in ("loss", "val_loss", "lr"):
            if key in row:
                assert key.encode() in logged and json.dumps(row[key]).encode() in logged, key


# ---- what a user sees for a bad configuration ----

def train_error(env, *args, nproc=1):
    return fails("train.py", *args, env=env, nproc=nproc).stderr


@pytest.mark.parametrize("args, message", [
    (["--learning_rat=1e-3"], "unknown key 'learning_rat'; did you mean learning_rate"),
    (["--batch_size=big"], "cannot read the value 'big'"),
    (["--batch_size=1.5"], "batch_size must be int, got 1.5"),
    (["--compile=1"], "compile must be bool"),
    (["--sampling=shuffle"], "sampling='shuffle' is not one of 'epoch', 'random', 'documents'"),
    (["--n_embd=100", "--n_head=3"], "n_embd=100 must be a multiple of n_head=3"),
    (["config/nope.py"], "config file config/nope.py does not exist"),
    (["--max_iters"], "settings are written --key=value"),
    (["--learning_rate=-1"], "learning_rate=-1.0 must be at least 0"),
    (["--learning_rate=1e999"], "learning_rate=inf must be at least 0"),
    (["--dropout=1"], "dropout=1.0 must be at least 0 and below 1"),
    (["--beta2=1.5"], "beta2=1.5 must be at least 0 and below 1"),
    (["--device=cuda"], "torch 2.13.0+cpu sees no CUDA device (built for CUDA none"),
    (["--device=tpu:3"], "device='tpu:3' is not a device: use auto, cpu, cuda"),
    (["--network_min_gbps=-1"], "network_min_gbps=-1.0 must be at least 0"),
    (["--network_check=maybe"], "network_check='maybe' is not one of 'auto', 'on', 'off', 'stop'"),
])
def test_configuration_errors_name_the_key(env, args, message):
    assert message in train_error(env, *args)


def test_openmp_threads_wait_passively(env):
    """As in sample.py and eval.py (docs/sampling.md): a plain `python train.py` on a loaded
    2-core machine ran the quick start ten times slower with OpenMP's threads spinning."""
    env.update(OMP_DISPLAY_ENV="VERBOSE")
    env.pop("OMP_WAIT_POLICY", None)
    assert PASSIVE in fails("train.py", "--device=tpu:3", env=env).stderr


@pytest.mark.slow
def test_config_file_that_does_not_parse(env, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("batch_size = 12\nlearning_rate = = 3\n")
    assert f"config file {bad} does not parse: line 2" in train_error(env, str(bad))
    bad.write_text("n_layr = 4\n")
    assert "unknown key 'n_layr'; did you mean n_layer" in train_error(env, str(bad))


def test_resume_without_a_checkpoint(env, corpus, tmp_path):
    err = train_error(env, f"--data_dir={corpus}", f"--out_dir={tmp_path}", *TINY,
                      "--init_from=resume")
    assert "holds no loadable checkpoint" in err


def test_out_dir_that_cannot_be_written(env, corpus, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    err = train_error(env, f"--data_dir={corpus}", f"--out_dir={blocker}/out", *TINY)
    assert f"cannot write in {blocker}/out (Not a directory): choose a folder" in err


@pytest.fixture(scope="module")
def two_rank_error(corpus, tmp_path_factory, session_env):
    """What 2 ranks print to stderr for gradient_accumulation_steps=3, which they cannot share:
    launched once, read by the two tests below."""
    out = tmp_path_factory.mktemp("two_rank_error")
    return train_error(session_env, f"--data_dir={corpus}", f"--out_dir={out}", *TINY,
                       "--gradient_accumulation_steps=3", nproc=2)


def test_errors_on_two_ranks_are_reported_once(two_rank_error):
    err = two_rank_error
    assert err.count("must be a multiple of the world size 2: use 2") == 1 and "(ranks 0, 1)" in err


def test_under_torchrun_the_error_is_followed_by_a_line_saying_torchruns_report_is_next(
        two_rank_error):
    """torchrun's ChildFailedError traceback (~30 lines) came after the error, and read as the
    answer."""
    lines = two_rank_error.splitlines()
    error = next(i for i, line in enumerate(lines) if line.startswith("train.py: error"))
    assert lines[error + 1] == "(torchrun's own report of how the ranks ended may follow: what " \
                               "happened is said above)", lines
    assert lines.count(lines[error + 1]) == 1  # from rank 0 alone


def test_a_settings_error_on_two_ranks_is_reported_once(env, tmp_path):
    """A key that cannot be read is the same on every rank (the same arguments and files):
    rank 0 says it once, with no rank named (was: once per rank)."""
    err = train_error(env, f"--out_dir={tmp_path}", "--batch_size=big", nproc=2)
    line = "train.py: error: argument --batch_size=big: cannot read the value 'big'"
    assert err.count("cannot read the value 'big'") == 1 and line in err, err


@pytest.mark.slow
def test_resume_with_another_architecture_is_an_error(wandb_run, env, corpus, tmp_path):
    """From a copy of wandb_run's checkpoint at iter 2 (n_layer=2)."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(wandb_run / "out" / "ckpt_0000002.pt", out / "ckpt_0000002.pt")
    args = [f"--data_dir={corpus}", f"--out_dir={out}", *TINY, "--gradient_accumulation_steps=1"]
    err = train_error(env, *args, "--n_layer=3", "--init_from=resume", "--max_iters=4")
    assert "n_layer=3 (2 there): the architecture comes from the checkpoint in" in err
    # the same keys at the checkpoint's values are fine, and the log says what is trained
    p = python("train.py", *args, "--n_layer=2", "--init_from=resume", "--max_iters=4",
               "--eval_interval=2", env=env)
    assert "  n_layer = 2\n" in p.stdout and "resuming from" in p.stdout


# ---- the GPU paths, as far as a CPU can show them ----

def test_cuda_means_each_ranks_own_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert runtime.pick_device("cuda", Ranks(3, 3, 8, 8)) == "cuda:3"
    assert runtime.pick_device("auto", Ranks(5, 5, 8, 8)) == "cuda:5"
    assert runtime.pick_device("cuda:1", Ranks(0, 0, 1, 1)) == "cuda:1"
    assert runtime.pick_device("cpu", Ranks(5, 5, 8, 8)) == "cpu"
    with pytest.raises(UserError, match="puts all 8 ranks of this node on one GPU"):
        runtime.pick_device("cuda:0", Ranks(2, 2, 8, 8))
    with pytest.raises(UserError, match="needs GPU cuda:9, but torch sees 8"):
        runtime.pick_device("cuda", Ranks(9, 9, 10, 10))


@pytest.mark.parametrize("gpus_seen, device", [(1, "cuda:0"), (8, "cuda:3")])
def test_one_srun_task_per_gpu_finds_its_gpu_and_its_nodes_ranks(monkeypatch, gpus_seen, device):
    """LAUNCHER=srun, 2 nodes of 8 tasks, this one the 4th task of the second node. A cluster
    that binds one GPU to each task (CUDA_VISIBLE_DEVICES=3, say) shows it one GPU, its
    cuda:0; another shows it all 8, and its GPU is cuda:<SLURM_LOCALID>."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in dict(SLURM_NTASKS="16", SLURM_PROCID="11", SLURM_LOCALID="3",
                            SLURM_NODEID="1", SLURM_STEP_TASKS_PER_NODE="8(x2)",
                            MASTER_ADDR="n1", MASTER_PORT="29500").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus_seen)
    ranks = runtime.ranks()
    assert ranks == Ranks(11, 3, 16, 8)
    assert os.environ["LOCAL_WORLD_SIZE"] == "8"  # as torchrun sets it
    assert runtime.pick_device("cuda", ranks) == runtime.pick_device("auto", ranks) == device
    # under torchrun, a rank that sees fewer GPUs than its node's ranks is still refused
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "1")
    if gpus_seen == 1:
        with pytest.raises(UserError, match="needs GPU cuda:3, but torch sees 1"):
            runtime.pick_device("cuda", ranks)


def test_slurm_tasks_per_node_of_uneven_nodes():
    for node, tasks in enumerate([4, 4, 2]):
        assert runtime.slurm_tasks_on_this_node(
            {"SLURM_STEP_TASKS_PER_NODE": "4(x2),2", "SLURM_NODEID": str(node)}) == tasks


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto is the GPU here")
def test_device_auto_on_the_cpu_says_so_where_the_job_was_given_gpus(monkeypatch, caplog):
    """A CPU build of torch, or a driver it cannot use, under a launcher that gave the job
    GPUs: one line says so. A CPU-only machine (no GPUs given, no NVIDIA driver) hears nothing,
    whatever its torch build."""
    for name in runtime.GPU_JOB_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    caplog.set_level(logging.INFO, logger="ddpgpt")
    assert runtime.pick_device("auto", Ranks(0, 0, 1, 1)) == "cpu"
    assert bool(caplog.messages) == os.path.exists(runtime.NVIDIA_DRIVER), caplog.messages
    caplog.clear()
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "8")
    assert runtime.pick_device("auto", Ranks(3, 3, 8, 8)) == "cpu"
    assert caplog.messages[0].startswith(f"note: device='auto' is the CPU: torch "
                                         f"{torch.__version__} sees no CUDA device")
    assert "SLURM_GPUS_ON_NODE=8" in caplog.messages[0]


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12), ("NVIDIA B200", 2250e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA L40S", 362e12), ("NVIDIA A10G", 70e12), ("Tesla T4", None)])
def test_mfu_peak_of_each_gpu_name(name, peak):
    assert runtime.peak_flops_of(name) == peak


def test_the_settling_backward_passes_two_tensors():
    """torch.compile guards on its arguments being one tensor or two: passing x twice would
    compile the graph again at the first real step."""
    seen = []

    def model(x, y):
        seen.append((x, y))
        return None, (x.float() * torch.ones((), requires_grad=True)).sum()

    parallel.settle_gradient_buckets(model, (2, 8), "cpu", contextlib.nullcontext())
    (x, y), = seen
    assert x is not y and x.shape == y.shape == (2, 8)


# ---- a backend or device that this machine's torch cannot serve ----

@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available() or torch.backends.mps.is_available(),
                    reason="the messages of a CPU-only torch")
def test_a_backend_or_device_this_torch_cannot_serve_is_refused_naming_what_it_can(
        env, corpus, tmp_path):
    args = [f"--data_dir={corpus}", f"--out_dir={tmp_path}", *TINY,
            "--gradient_accumulation_steps=2"]
    version = torch.__version__
    err = train_error(env, *args, "--backend=nccl", nproc=2)  # was init_process_group's ValueError
    assert f"backend='nccl', but torch {version} was built without it (a CPU build): it has " \
           f"gloo; use --backend=gloo, or leave backend unset" in err, err
    can = f"This machine's torch {version} can run on: cpu."
    err = train_error(env, *args, "--device=mps")  # was "not linked with support for mps"
    assert f"device='mps', but torch {version} has no MPS device here (Apple's GPUs, on " \
           f"macOS). {can}" in err, err
    for device in ("xpu", "meta"):
        err = train_error(env, *args, f"--device={device}")
        assert f"device='{device}': ddpgpt does not run on {device} devices. {can}" in err, err


def test_the_backend_follows_the_device(monkeypatch):
    assert launch.check_backend("", "cpu") == "gloo"
    assert launch.check_backend("gloo", "cuda:0") == "gloo"  # bench.py gpu's two ranks on one
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    assert launch.check_backend("", "cuda:1") == "nccl"
    with pytest.raises(UserError, match="backend='nccl' all-reduces CUDA tensors only, and "
                                        "device='cpu': use --backend=gloo"):
        launch.check_backend("nccl", "cpu")


def test_mps_runs_one_process(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert runtime.pick_device("mps", Ranks(0, 0, 1, 1)) == "mps"
    with pytest.raises(UserError, match="device='mps' runs one process only"):
        runtime.pick_device("mps", Ranks(1, 1, 2, 2))
