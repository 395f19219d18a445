"""launch/ on a real SLURM: ../shared/slurm/up.sh starts a private munged, slurmctld and two
slurmd posing as nodes n1 and n2 (8 fake GPUs each) on this host, for this module only, and
down.sh stops exactly those. The jobs are the real launch/slurm.sbatch with 2 nodes x 2 ranks
(NPROC_PER_NODE=2, gloo, a tiny model on the CPU): training to the end, a USR1 that stops,
requeues and resumes the job on the same batches, a SIGTERM, a failing rank, a killed rank that
torchrun restarts within the job, a config file's init_from, one srun task per rank, and the
flight recorder settings each rank gets."""
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import ROOT, TINY, batches_and_losses, evals, run, steps
from test_restarts import kill_at_steps

SLURM_SCRIPTS = os.path.join(ROOT, "..", "shared", "slurm")
TINY = [*TINY, "--n_layer=1", "--backend=gloo", "--gradient_accumulation_steps=4",
        "--lr_decay_iters=300"]
# a few seconds on 4 CPU ranks: long enough for a signal to land mid-run (a USR1 sent at step 3
# stopped the job at step 14, at a load of 15 on 2 cores), and for the killed-rank test's two
# kills and restarts (at steps 40 and 80, 40 steps before the end); each of these 4-rank jobs
# trains all of its steps (180 before: a third of them were margin)
MAX_ITERS = 120
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"}


def _free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _cluster_ports():
    """slurmctld's port and the first of two slurmd ports, free now, below launch/srun.sh's
    rendezvous ports (20000-28999) and below the ephemeral range."""
    for _ in range(100):
        ctld = random.randrange(17000, 19900, 10)
        if all(_free(p) for p in (ctld, ctld + 4, ctld + 5)):
            return ctld, ctld + 4
    raise RuntimeError("no free ports for the test cluster")


@pytest.fixture(scope="module")
def slurm(tiktoken_cache):
    """A SLURM cluster of two nodes, n1 and n2, for this module; yields the environment that
    submits to it: a user's shell with SLURM_CONF, python with torch first on PATH."""
    if os.geteuid() != 0:
        pytest.skip("the test SLURM cluster (../shared/slurm/up.sh) must be started as root")
    up = os.path.join(SLURM_SCRIPTS, "up.sh")
    if not os.path.exists(up):  # a plain clone: the CI machines have it, a user's rarely
        pytest.skip(f"no test SLURM cluster: {os.path.normpath(up)}, which starts one, is not "
                    f"beside the checkout")
    base = tempfile.mkdtemp(prefix="ddpgpt_slurm_", dir="/tmp")  # up.sh: /two/levels deep
    os.chmod(base, 0o755)  # munged runs as the munge user and must reach its folder in it
    ctld, slurmd0 = _cluster_ports()
    cluster = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    cluster.update(BASE=base, NODES="2", CPUS_PER_NODE="8", GPUS_PER_NODE="8",
                   CTLD_PORT=str(ctld), SLURMD_PORT0=str(slurmd0))
    try:
        p = subprocess.run(["bash", up], env=cluster, capture_output=True, text=True,
                           timeout=1200)  # the first run installs slurm-wlm and munge
        if p.returncode != 0:
            logs = ""
            for name in sorted(os.listdir(os.path.join(base, "log"))) \
                    if os.path.isdir(os.path.join(base, "log")) else []:
                with open(os.path.join(base, "log", name), errors="replace") as f:
                    logs += f"--- {name}\n{f.read()[-2000:]}\n"
            pytest.fail(f"up.sh exited {p.returncode}\n{p.stdout}\n{p.stderr}\n{logs}")
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("SLURM") and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
        env.update(SLURM_CONF=os.path.join(base, "etc", "slurm.conf"),
                   PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
                   PYTHON=sys.executable, NPROC_PER_NODE="2", TIKTOKEN_CACHE_DIR=tiktoken_cache,
                   OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE="offline",
                   PYTHONPATH=ROOT,
                   # not the default folder in the checkout, which the jobs would fill
                   TORCH_FR_DUMP_TEMP_FILE=os.path.join(base, "flight_recorder", "rank_"))
        yield env
    finally:
        subprocess.run(["bash", os.path.join(SLURM_SCRIPTS, "down.sh")], env=cluster,
                       capture_output=True, text=True, timeout=300)
        shutil.rmtree(base, ignore_errors=True)


# ---- helpers ----

def sbatch(env, log, *train_args, nodes=2, **extra_env):
    """Submit launch/slurm.sbatch from the repository root, as a user does; the job id."""
    p = run(["sbatch", "--parsable", f"--nodes={nodes}", f"--output={log}",
             "launch/slurm.sbatch", *map(str, train_args)], dict(env, **extra_env))
    return p.stdout.strip().split(";")[0]


def train_job(env, corpus, folder, *train_args, **extra_env):
    """sbatch of TINY on the corpus into folder/out, logged in folder/job.log: (job id, log,
    out_dir)."""
    log, out = str(folder / "job.log"), str(folder / "out")
    return sbatch(env, log, f"--data_dir={corpus}", f"--out_dir={out}", *TINY, *train_args,
                  **extra_env), log, out


def job(env, job_id):
    """JobState, Restarts and ExitCode of a job, from scontrol."""
    out = run(["scontrol", "show", "job", "-o", job_id], env).stdout
    return {k: re.search(rf"\b{k}=(\S+)", out).group(1)
            for k in ("JobState", "Restarts", "ExitCode")}


def read(path):
    with open(path, errors="replace") as f:
        return f.read()


def wait_for(env, job_id, log, until, timeout=240, what="the job"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job(env, job_id)
        if until(info):
            return info
        time.sleep(0.3)
    run(["scancel", job_id], env, check=False)
    raise AssertionError(f"{what} did not happen in {timeout} s: {job(env, job_id)}\n"
                         f"--- {log}\n{read(log) if os.path.exists(log) else ''}")


def wait_done(env, job_id, log, timeout=240):
    """The ended job's state (job()) and its log."""
    return wait_for(env, job_id, log, lambda i: i["JobState"] in FINAL_STATES, timeout,
                    "the end of the job"), read(log)


def checkpoints(out_dir):
    return sorted(f for f in os.listdir(out_dir) if f.startswith("ckpt_"))


def wait_for_steps(env, job_id, log, out_dir, n, timeout):
    """Until the running job has logged n steps in out_dir's metrics.jsonl."""
    metrics = os.path.join(out_dir, "metrics.jsonl")
    deadline = time.monotonic() + timeout
    while not (os.path.exists(metrics) and len(steps(out_dir)) >= n):
        assert time.monotonic() < deadline and job(env, job_id)["JobState"] in (
            "PENDING", "CONFIGURING", "RUNNING"), read(log) if os.path.exists(log) else ""
        time.sleep(0.1)


def usr1_then_start_requeued(env, job_id, log):
    """USR1 to the batch script, as SLURM sends it at --signal=B:USR1@<seconds> before the time
    limit. SLURM then holds the requeued job for about two minutes (BeginTime): once both nodes
    are idle and the old job's credential is at least a second old, start it at once."""
    run(["scancel", "--signal=USR1", "--batch", job_id], env)
    wait_for(env, job_id, log, lambda i: i["JobState"] == "PENDING" and i["Restarts"] == "1",
             what="the requeue")
    deadline = time.monotonic() + 60
    while set(run(["sinfo", "-h", "-N", "-o", "%T"], env).stdout.split()) != {"idle"}:
        assert time.monotonic() < deadline, run(["sinfo", "-N"], env).stdout
        time.sleep(0.3)
    time.sleep(2)
    run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env)


# ---- the tests ----

@pytest.fixture(scope="module")
def uninterrupted(slurm, corpus, tmp_path_factory):
    """One job of 2 nodes x 2 ranks from start to max_iters: (job id, log, out_dir)."""
    job_id, log, out = train_job(slurm, corpus, tmp_path_factory.mktemp("uninterrupted"),
                                 f"--max_iters={MAX_ITERS}", f"--eval_interval={MAX_ITERS}",
                                 "--log_interval=100")
    info, text = wait_done(slurm, job_id, log)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text)
    return job_id, log, out


@pytest.mark.slow
def test_two_nodes_of_two_ranks_train_to_the_end(uninterrupted):
    job_id, log, out = uninterrupted
    text = read(log)
    assert "world size 4," in text, text
    assert "2 node(s) x 2 rank(s), torchrun" in text
    # the rendezvous port: from the job id, below the ephemeral ports
    port = int(re.search(r"rendezvous n1:(\d+)", text).group(1))
    assert port == 20000 + int(job_id) % 9000 and port < 32768
    assert "resuming" not in text and "init_from = 'auto'" in text
    assert text.count("saved ") == 1 and f"ckpt_{MAX_ITERS:07d}.pt" in text
    assert checkpoints(out) == [f"ckpt_{MAX_ITERS:07d}.pt"]
    assert sorted(steps(out)) == list(range(MAX_ITERS))
    assert [e["iter"] for e in evals(out)] == [0, MAX_ITERS]
    assert "slurm.sbatch: done, exit code 0" in text


@pytest.mark.slow
def test_usr1_saves_requeues_and_resumes_on_the_same_batches(slurm, corpus, uninterrupted,
                                                             tmp_path):
    job_id, log, out = train_job(slurm, corpus, tmp_path, f"--max_iters={MAX_ITERS}",
                                 f"--eval_interval={MAX_ITERS}", "--log_interval=100")
    wait_for_steps(slurm, job_id, log, out, 3, timeout=120)
    usr1_then_start_requeued(slurm, job_id, log)
    info, text = wait_done(slurm, job_id, log)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, text)

    stopped = int(re.search(r"stopping at iter (\d+): signal received", text).group(1))
    assert 3 <= stopped < MAX_ITERS, text
    first, second = text.split("requeueing job")
    assert f"saved {out}/ckpt_{stopped:07d}.pt" in first
    assert "restart 1," in second and "(restart 1)" in second  # SLURM_RESTART_COUNT
    assert f"resuming from {out}/ckpt_{stopped:07d}.pt (iter {stopped})" in second
    assert checkpoints(out) == [f"ckpt_{stopped:07d}.pt", f"ckpt_{MAX_ITERS:07d}.pt"]

    # the same global batches and the same losses, bit for bit, as the uninterrupted job
    assert sorted(steps(out)) == list(range(MAX_ITERS))
    assert batches_and_losses(out) == batches_and_losses(uninterrupted[2])
    assert evals(out)[-1] == evals(uninterrupted[2])[-1] and evals(out)[-1]["iter"] == MAX_ITERS


@pytest.mark.slow
def test_fsdp_on_two_nodes_saves_each_ranks_part_at_usr1_and_resumes_from_it(slurm, corpus,
                                                                             tmp_path):
    """launch/ passes --parallel=fsdp through like any key: 4 ranks on 2 nodes write their
    parts of one checkpoint folder at the USR1 stop, and the requeued job resumes from it."""
    # 40 steps: the USR1 sent at step 3 lands by step ~14 even at a load of 15 (MAX_ITERS)
    iters = 40
    job_id, log, out = train_job(slurm, corpus, tmp_path, "--parallel=fsdp",
                                 f"--max_iters={iters}", f"--eval_interval={iters}",
                                 "--log_interval=100")
    wait_for_steps(slurm, job_id, log, out, 3, timeout=180)
    usr1_then_start_requeued(slurm, job_id, log)
    info, text = wait_done(slurm, job_id, log, timeout=400)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, text)
    stopped = int(re.search(r"stopping at iter (\d+): signal received", text).group(1))
    assert 3 <= stopped < iters and "parallel = 'fsdp'" in text, text
    first, second = text.split("requeueing job")
    assert f"saved {out}/ckpt_{stopped:07d} (" in first
    assert f"resuming from {out}/ckpt_{stopped:07d} (iter {stopped})" in second
    assert checkpoints(out) == [f"ckpt_{stopped:07d}", f"ckpt_{iters:07d}"]
    parts = sorted(os.listdir(os.path.join(out, f"ckpt_{iters:07d}")))
    assert parts == [".metadata", *(f"__{r}_0.distcp" for r in range(4)), "values.pt"]
    assert sorted(steps(out)) == list(range(iters))


@pytest.mark.slow
def test_sigterm_saves_at_one_step_and_a_cancelled_job_stays_cancelled(slurm, corpus, tmp_path):
    job_id, log, out = train_job(slurm, corpus, tmp_path, f"--max_iters={MAX_ITERS}",
                                 f"--eval_interval={MAX_ITERS}")
    wait_for_steps(slurm, job_id, log, out, 3, timeout=120)
    run(["scancel", job_id], slurm)  # SIGTERM to every process, SIGKILL after KillWait (5 s)
    info = wait_done(slurm, job_id, log)[0]
    time.sleep(1)
    text = read(log)
    assert info["JobState"] == "CANCELLED" and job(slurm, job_id)["Restarts"] == "0", text
    stopped = int(re.search(r"stopping at iter (\d+): signal received", text).group(1))
    assert f"saved {out}/ckpt_{stopped:07d}.pt" in text, text
    assert checkpoints(out) == [f"ckpt_{stopped:07d}.pt"]
    assert sorted(steps(out)) == list(range(stopped)) and "requeueing" not in text


@pytest.mark.slow
def test_a_failing_rank_ends_the_job_at_once_with_its_error(slurm, corpus, tmp_path):
    t0 = time.monotonic()
    # rank 3 (on the second node) fails reading its 5th batch; the collective timeout stays
    # at 600 s, which the job must not wait for
    job_id, log, out = train_job(
        slurm, corpus, tmp_path, f"--max_iters={MAX_ITERS}", f"--eval_interval={MAX_ITERS}",
        "--dist_timeout_s=600", TRAIN_SCRIPT=os.path.join(ROOT, "tests", "launch_failing_rank.py"),
        FAIL_RANK="3", FAIL_AFTER="5")
    info = wait_done(slurm, job_id, log, timeout=180)[0]
    elapsed = time.monotonic() - t0
    text = read(log)
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", (info, text)
    assert elapsed < 120, (elapsed, text)
    assert "OSError: injected read error on rank 3" in text
    assert re.search(r"srun: error: n\d: task \d: Exited with exit code 1", text), text
    assert "requeueing" not in text and not checkpoints(out)


@pytest.mark.slow
def test_a_killed_rank_restarts_within_the_job_and_goes_on_on_the_same_batches(
        slurm, corpus, uninterrupted, tmp_path):
    """MAX_RESTARTS=2: kill -9 of rank 3 (on n2), then of rank 0 (on n1). Each torchrun restarts
    its ranks within the job step, they resume from the newest checkpoint (a checkpoint every
    30 steps: one before each kill and one between them), and the steps are the uninterrupted
    job's, bit for bit."""
    job_id, log, out = train_job(slurm, corpus, tmp_path, f"--max_iters={MAX_ITERS}",
                                 "--eval_interval=30", "--log_interval=100", MAX_RESTARTS="2")
    kill_at_steps(out, [(40, 3, signal.SIGKILL), (80, 0, signal.SIGKILL)], procs=[])
    info, text = wait_done(slurm, job_id, log)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", (info, text)
    assert "max restarts 2" in text and text.count("resuming from") == 2, text
    assert sorted(steps(out)) == list(range(MAX_ITERS))
    assert batches_and_losses(out) == batches_and_losses(uninterrupted[2])


@pytest.mark.slow
def test_an_init_from_in_a_config_file_wins_over_the_batch_scripts_auto(slurm, corpus, tmp_path):
    """slurm.sbatch passes --init_from=auto before the user's arguments: a config file's
    init_from (here resume, in an out_dir with no checkpoint) is the one train.py takes (one
    rank on one node: each rank reads the same arguments)."""
    log, out, config = str(tmp_path / "job.log"), str(tmp_path / "out"), tmp_path / "resume.py"
    config.write_text('init_from = "resume"\n')
    job_id = sbatch(slurm, log, config, f"--data_dir={corpus}", f"--out_dir={out}", *TINY,
                    "--max_iters=10", nodes=1, NPROC_PER_NODE="1")
    info, text = wait_done(slurm, job_id, log)
    assert info["JobState"] == "FAILED", (info, text)
    assert f"init_from='resume' but {out} holds no loadable checkpoint" in text, text


@pytest.mark.slow
def test_one_srun_task_per_rank(slurm, corpus, tmp_path):
    """LAUNCHER=srun: no torchrun; train.py takes its rank from SLURM_PROCID."""
    job_id, log, out = train_job(slurm, corpus, tmp_path, "--max_iters=10", "--eval_interval=10",
                                 LAUNCHER="srun")
    info, text = wait_done(slurm, job_id, log)
    assert info["JobState"] == "COMPLETED", (info, text)
    assert "2 node(s) x 2 rank(s), srun" in text and "world size 4," in text
    assert checkpoints(out) == ["ckpt_0000010.pt"] and sorted(steps(out)) == list(range(10))


FLIGHT_RECORDER = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE")


def test_every_rank_gets_the_flight_recorder_settings(slurm, tmp_path):
    """On by default, dumps in flight_recorder/<job>-<restart>/ where the job was submitted;
    a setting of the user's wins."""
    log = str(tmp_path / "job.log")
    env = {k: v for k, v in slurm.items() if k not in FLIGHT_RECORDER}
    job_id = sbatch(env, log, *FLIGHT_RECORDER, TORCH_FR_BUFFER_SIZE="4000",
                    TRAIN_SCRIPT=os.path.join(ROOT, "tests", "print_rank_env.py"))
    folder = os.path.join(ROOT, "flight_recorder", f"{job_id}-0")
    try:
        info, text = wait_done(slurm, job_id, log)
        assert info["JobState"] == "COMPLETED", (info, text)
        assert (f"srun.sh: NCCL flight recorder: the last 4000 collectives of each rank, written "
                f"on a collective timeout to {folder}/rank_<rank>") in text, text
        seen = sorted(re.findall(r"^rank (\d+): (.*)$", text, re.MULTILINE))
        assert seen == [(str(r), f"TORCH_FR_BUFFER_SIZE=4000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 "
                                 f"TORCH_FR_DUMP_TEMP_FILE={folder}/rank_") for r in range(4)]
        assert os.path.isdir(folder)  # made on each node: torch writes into it, it makes none
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if os.path.isdir(os.path.dirname(folder)) and not os.listdir(os.path.dirname(folder)):
            os.rmdir(os.path.dirname(folder))


def test_srun_sh_outside_an_allocation(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    p = run(["bash", os.path.join(ROOT, "launch", "srun.sh"), "config/owt.py"], env, check=False)
    assert p.returncode == 2 and "not inside a SLURM allocation" in p.stderr


@pytest.mark.parametrize("extra, message", [
    ({"MAX_RESTARTS": "three"}, "MAX_RESTARTS=three: give a number of restarts, e.g. 3"),
    ({"MAX_RESTARTS": "2", "LAUNCHER": "srun"},
     "MAX_RESTARTS=2 needs LAUNCHER=torchrun: with one srun task per rank, a dead rank ends "
     "the job")])
def test_srun_sh_refuses_restarts_it_cannot_make(tmp_path, extra, message):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    p = run(["bash", os.path.join(ROOT, "launch", "srun.sh")], dict(env, SLURM_JOB_ID="1",
                                                                    **extra), check=False)
    assert p.returncode == 2 and f"srun.sh: {message}" in p.stderr, p.stderr
