"""What the tests share: they run the scripts as a user would, in subprocesses, on small data.

  env            a user's shell, offline, one thread per process, GPT-2's vocabulary cached
                 (from tests/fixtures/r50k_base.tiktoken: a plain clone needs nothing beside it)
  python(...)    python <script> <args>; torchrun(n, ...) the same on n ranks (gloo, CPU);
                 on_ranks(n, ...) either, as a user starts n ranks; started(...), left running
  fails(...)     a run that must end in one clear error: exit 1 and no traceback of ours
  corpus         stdlib_data(...): a few standard-library modules, prepared (byte tokenizer)
  write_token_files(...)  a data folder from arrays of ids
  TINY           a model of a few thousand parameters that trains in seconds on a CPU;
                 train_args(data_dir, out_dir, ...) train.py's arguments for it
  metrics(out)   the rows of out/metrics.jsonl; steps(out) the step rows by iter
  read_with_ranks(...)  what each rank of a torchrun job reads through loader.rank_batches
  decoded(out, tokenizer)  the documents of a prepared folder, its meta.json checked
  small_disk     a real 1 MiB file system (a tmpfs; skipped without root), for full disks;
                 another size by indirect parametrization
"""
import contextlib
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time

import numpy as np
import psutil
import pytest

from ddpgpt import checkpoint, docindex, tokenfile
from ddpgpt.tokenizer import install_tiktoken_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# GPT-2's vocabulary in tiktoken's file (OpenAI's, MIT licence), shipped so that the tests need
# no network and nothing beside the checkout; its sha256 is the one tiktoken checks for r50k_base
VOCAB = os.path.join(ROOT, "tests", "fixtures", "r50k_base.tiktoken")
VOCAB_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# what prepare.py writes by default
OUTPUTS = ("train.bin", "val.bin", tokenfile.META_NAME, "train.docidx", "val.docidx")
# 8 micro-steps a step, not train.py's 40 (nanoGPT's): no test checks that number, the world
# sizes the tests train on (1, 2, 4) divide 8, and the micro-steps were most of a tiny run's
# time after its imports
TINY = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4",
        "--gradient_accumulation_steps=8", "--eval_iters=4", "--device=cpu",
        "--learning_rate=3e-3", "--warmup_iters=2", "--lr_decay_iters=40", "--min_lr=3e-4"]


def train_args(data_dir, out_dir, *args):
    """train.py's arguments for the TINY model on data_dir, into out_dir, then args."""
    return [f"--data_dir={data_dir}", f"--out_dir={out_dir}", *TINY, *args]


@pytest.fixture(autouse=True)
def unconfigured_logging():
    """Each test starts with the 'ddpgpt' logger as in a process that never called logs.setup()
    (its lines reach the root logger, and caplog): a test that set it up in this process (the
    Lightning example's DataModule) leaves no handler on a stream pytest has replaced."""
    yield
    logger = logging.getLogger("ddpgpt")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.setLevel(logging.NOTSET)
    logger.propagate = True

def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pytest.ini): one test file per core, and one more. Part of the suite waits
    (for a restart, a SLURM job, a watchdog's limit, a killed rank's peers) with its cores
    idle: two workers on two cores kept them 83% busy; the third fills the waits."""
    return (os.cpu_count() or 1) + 1


@pytest.fixture(scope="session")
def tiktoken_cache(tmp_path_factory):
    """A tiktoken cache folder holding the GPT-2 vocabulary, so 'gpt2' loads offline."""
    with open(VOCAB, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    assert digest == VOCAB_SHA256, f"{VOCAB} is damaged (sha256 {digest}): git checkout it again"
    cache = str(tmp_path_factory.mktemp("tiktoken_cache"))
    install_tiktoken_file(VOCAB, cache)
    return cache


@pytest.fixture(scope="session")
def session_env(tiktoken_cache):
    """The environment a user's shell would have, offline, one thread per process, with this
    checkout importable (by tests/*.py's programs), and no torchrun variables of a caller that
    would make a child think it is a rank."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return dict(env, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")])),
                TIKTOKEN_CACHE_DIR=tiktoken_cache, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", WANDB_MODE="offline")


@pytest.fixture
def env(session_env):
    """session_env, as a copy a test may change."""
    return dict(session_env)


def run(args, env, cwd=ROOT, timeout=600, check=True):
    """Run a command like a user would; on an unexpected exit code show all it printed, and
    when it hangs, that and where each of its processes was (a hang seen once in CI must be
    understood from its log)."""
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        where = stacks_then_kill(proc.pid)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"{args} did not end in {timeout} s\n--- stdout\n{stdout}\n"
                             f"--- stderr\n{stderr}\n--- where its processes were\n{where}")
    p = subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)
    if check and p.returncode != 0:
        raise AssertionError(f"{args} exited {p.returncode}\n--- stdout\n{p.stdout}\n"
                             f"--- stderr\n{p.stderr}")
    return p


def stacks_then_kill(pid):
    """py-spy's dump of the Python stacks (and the native frames) of pid and its descendants,
    which are then killed: torchrun's ranks too, which would keep the output pipes open. It
    ends with each process's main thread in one line: CI's log keeps a failure's first and last
    lines only, and the dumps of four ranks fill the middle."""
    tree = process_tree(pid)
    ranks = [rank_of(p) for p in tree]
    dumps = [subprocess.run(["py-spy", "dump", "--native", "--pid", str(p.pid)],
                            capture_output=True, text=True, timeout=60) for p in tree]
    kill(tree)
    where = [f"{p.pid} ({rank}): {main_thread_frames(d.stdout) or d.stderr.strip()}"
             for p, rank, d in zip(tree, ranks, dumps)]
    return "\n".join([*(d.stdout + d.stderr for d in dumps),
                      "--- each main thread, innermost first: native frames | Python frames",
                      *where])


def process_tree(pid):
    """A process and all its descendants: torchrun starts every rank in a session of its own,
    which a kill of the launcher's process group would not reach."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def kill(processes):
    for p in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


def rank_of(process):
    with contextlib.suppress(psutil.Error, KeyError):
        return f"rank {process.environ()['RANK']}"
    return "no RANK"


def main_thread_frames(dump, count=3):
    """The main thread in a py-spy dump: its innermost native frames outside libc (where a
    wait in C++ waits) and its innermost Python frames."""
    thread = dump.partition('"MainThread"')[2].split("\nThread ")[0]
    frames = re.findall(r"^ +(\S+ \((\S+)\))$", thread, re.M)
    python = [f for f, where in frames if re.search(r"\.py:\d+$", where)]
    native = [f for f, where in frames if f not in python and not where.startswith("libc.")]
    return f"{' < '.join(native[:count])} | {' < '.join(python[:count])}" if frames else ""


def torchrun_command(nproc):
    """The start of a torchrun command line, as a user types it. benchmarks/common.py has its
    own: the tests stand on nothing of the benchmarks' but what they test."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}"]


def ranks_command(nproc):
    """torchrun's command line, or for one rank plain python, as a user runs train.py on one:
    one rank has no process group (launch.init_distributed)."""
    return torchrun_command(nproc) if nproc > 1 else [sys.executable]


def python(script, *args, env, **kw):
    return run([sys.executable, os.path.join(ROOT, script), *map(str, args)], env, **kw)


def torchrun(nproc, script, *args, env, **kw):
    return run([*torchrun_command(nproc), os.path.join(ROOT, script), *map(str, args)], env, **kw)


def on_ranks(nproc, script, *args, env, **kw):
    return run([*ranks_command(nproc), os.path.join(ROOT, script), *map(str, args)], env, **kw)


def started(command, env, log, **kw):
    """command started as run() starts it, left running, all it prints going to the file log."""
    with open(log, "w") as f:
        return subprocess.Popen([*map(str, command)], cwd=ROOT, env=env, stdout=f,
                                stderr=subprocess.STDOUT, **kw)


def wait_for_line(log, pattern, proc, timeout):
    """Until a line of the file log matches pattern, while proc runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if re.search(pattern, log.read_text()):
            return
        assert proc.poll() is None, log.read_text()
        time.sleep(0.1)
    raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n{log.read_text()}")


def traceback_of_ours(text):
    """Does text hold a traceback's frame in our files: the package and the scripts, not a
    virtual environment inside the checkout (torchrun's own traceback runs through it)?"""
    return re.search(rf'File "{re.escape(ROOT)}/(ddpgpt/|examples/|[^/"]+")', text) is not None


def fails(script, *args, env, nproc=1, **kw):
    """A run that must fail with one clear error: exit 1, and no traceback from our files
    (under torchrun, torchrun prints its own summary of the failed ranks)."""
    p = on_ranks(nproc, script, *args, env=env, check=False, **kw)
    assert p.returncode != 0 if nproc > 1 else p.returncode == 1, p.stdout + p.stderr
    assert not (traceback_of_ours(p.stderr) if nproc > 1 else "Traceback" in p.stderr), p.stderr
    return p


def write_token_files(data_dir, ids_by_split, *, tokenizer, vocab_size, eot_token):
    """A complete data folder from arrays of ids, with each split's document index (documents
    counted by their end-of-text ids). benchmarks/common.py writes its random data alike: the
    tests stand on nothing of the benchmarks' but what they test."""
    os.makedirs(data_dir, exist_ok=True)
    dtype, splits = tokenfile.token_dtype(vocab_size), {}
    for split, ids in ids_by_split.items():
        path = os.path.join(data_dir, f"{split}.bin")
        ids = np.asarray(ids, dtype=dtype)
        ids.tofile(path)
        splits[split] = tokenfile.describe_split(path, dtype,
                                                 int(np.count_nonzero(ids == eot_token)))
    tokenfile.write_meta(data_dir, tokenizer=tokenizer, vocab_size=vocab_size,
                         eot_token=eot_token, splits=splits)
    for split in ids_by_split:
        docindex.build(tokenfile.open_split(data_dir, split, 1),
                       docindex.doc_index_path(data_dir, split), eot_token)


def read_with_ranks(env, folder, out, nproc, micro_steps, start_step=0, steps=3, batch=4,
                    block=32, mode="epoch"):
    """Per rank: the first token of each window it read (tests/rank_reader.py), and its RSS."""
    torchrun(nproc, "tests/rank_reader.py", folder, out, block, batch, micro_steps, start_step,
             steps, mode, env=env)
    ranks = []
    for path in sorted(glob.glob(f"{out}.rank*.json")):
        with open(path) as f:
            ranks.append(json.load(f))
        os.remove(path)
    assert len(ranks) == nproc
    return ranks


def global_batches(ranks):
    """{step: sorted offsets read by all ranks and micro-steps together}"""
    batches = {}
    for r in ranks:
        for read in r["reads"]:
            assert read["shift_ok"]
            batches.setdefault(read["step"], []).extend(read["first_tokens"])
    return {s: sorted(v) for s, v in batches.items()}


def decoded(out_dir, tok):
    """{split: [document, ...]} decoded from the token files, checking meta.json on the way."""
    meta = json.loads((out_dir / tokenfile.META_NAME).read_text())
    assert meta["format_version"] == tokenfile.FORMAT_VERSION
    assert meta["dtype"] == tokenfile.token_dtype(tok.vocab_size).name
    assert (meta["vocab_size"], meta["eot_token"], meta["tokenizer"]) == \
        (tok.vocab_size, tok.eot, tok.name)
    docs = {}
    for split in tokenfile.SPLITS:
        path = out_dir / f"{split}.bin"
        tokens = np.fromfile(path, dtype=meta["dtype"])
        info = meta["splits"][split]
        assert tokens[-1] == tok.eot  # every document ends with end-of-text
        ends = np.flatnonzero(tokens == tok.eot)
        assert info == {"tokens": len(tokens), "documents": len(ends),
                        "fingerprint": tokenfile.sampled_fingerprint([path])}
        tokenfile.open_split(str(out_dir), split, block_size=1)  # what training will check
        starts = np.concatenate([[0], ends[:-1] + 1])
        docs[split] = [tok.decode(tokens[a:b].tolist()) for a, b in zip(starts, ends)]
    assert not glob.glob(str(out_dir / "*.tmp"))
    return docs


def read_all(folder):
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


def prepare_fails(tmp_path, *args, env):
    """prepare.py run in tmp_path on bad input: its one-line message, checked to be one, and
    that nothing it writes (final or temporary) is left anywhere in tmp_path."""
    p = fails("prepare.py", *args, env=env, cwd=tmp_path)
    message = p.stderr.strip().splitlines()[-1]
    assert message.startswith("prepare.py: error: "), p.stderr
    left = [f for f in glob.glob(f"{tmp_path}/**/*", recursive=True)
            if f.endswith(OUTPUTS + (".tmp",))]
    assert not left
    return message


def metrics(out_dir):
    """The rows of out_dir/metrics.jsonl, complete ones only: tests read it during a run too,
    where the last line may be still being written."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def steps(out_dir):
    """{iter: the row of that training step}; a step logged twice (a restart) counts last."""
    return {r["iter"]: r for r in metrics(out_dir) if "loss" in r}


def evals(out_dir):
    return [r for r in metrics(out_dir) if "val_loss" in r]


def last_json(stdout):
    """The JSON object eval.py prints last."""
    return json.loads(stdout.strip().splitlines()[-1])


def rows_so_far(out_dir):
    """metrics(out_dir) of a run under way: none before it has written its first."""
    return metrics(out_dir) if os.path.exists(os.path.join(out_dir, "metrics.jsonl")) else []


def wait_for_step(out_dir, step, proc, timeout=120):
    """Until proc's run has logged a row of step or later in out_dir's metrics.jsonl."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, "the run ended before the step it was to be killed at"
        if any(r.get("iter", -1) >= step for r in rows_so_far(out_dir)):
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} never came")


def batches_and_losses(out_dir, iters=None):
    """{iter: (batch_fp, loss)} of out_dir's steps (of those iters only, if given): what a run
    that repeats another must match."""
    rows = steps(out_dir)
    return {i: (rows[i]["batch_fp"], rows[i]["loss"]) for i in (rows if iters is None else iters)}


def first_steps(run, k, out, *more):
    """out as a run with run's settings leaves it when stopped at iter k: a copy of run's
    checkpoint at k (and at each iter of more) and the rows run wrote before iter k."""
    os.makedirs(out)
    for i in (k, *more):
        shutil.copy(checkpoint.path_for(run, i), out)
    with open(os.path.join(run, "metrics.jsonl")) as f:
        rows = [line for line in f if json.loads(line)["iter"] < k]
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.writelines(rows)
    return str(out)


def resumed_from(source, out, nproc, args, at, env):
    """out, a new out_dir holding a copy of the checkpoint source (of iter at), which train.py's
    args (out_dir out among them) resume on nproc ranks (on_ranks)."""
    os.makedirs(out)
    copied = os.path.join(out, os.path.basename(source))
    (shutil.copytree if os.path.isdir(source) else shutil.copy)(source, copied)
    p = on_ranks(nproc, "train.py", *args, "--init_from=resume", env=env)
    assert f"resuming from {copied} (iter {at})" in p.stdout
    return str(out)


def same_on_any_world_size_and_resumed(args, tmp_path, env, steps_in_all=6):
    """train.py on 1 rank, on 2, and the 2-rank run's first half (a copy: args save a
    checkpoint halfway) resumed: the three read the same global batches, and the resumed run's
    losses are the uninterrupted one's. The 1-rank run's (out_dir, CompletedProcess), for what
    a test checks beyond that."""
    one, two, halves = (str(tmp_path / n) for n in ("one", "two", "halves"))
    half, every = steps_in_all // 2, range(steps_in_all)
    p = python("train.py", *args, f"--out_dir={one}", f"--max_iters={steps_in_all}", env=env)
    torchrun(2, "train.py", *args, f"--out_dir={two}", f"--max_iters={steps_in_all}", env=env)
    first_steps(two, half, halves)
    resumed = torchrun(2, "train.py", *args, f"--out_dir={halves}",
                       f"--max_iters={steps_in_all}", "--init_from=resume", env=env)
    assert f"resuming from {checkpoint.path_for(halves, half)} (iter {half})" in resumed.stdout
    a, b, c = steps(one), steps(two), steps(halves)
    assert sorted(a) == sorted(b) == sorted(c) == list(every)
    assert [a[i]["batch_fp"] for i in every] == [b[i]["batch_fp"] for i in every]
    assert batches_and_losses(two) == batches_and_losses(halves)
    return one, p


class RunsCode:
    """Unpickling this would run a command: a checkpoint or a meta.pkl must never be loaded that
    way."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def stdlib_data(root, modules, tokenizer, env):
    """root/data: standard-library modules as text files (root/docs), prepared with tokenizer."""
    (root / "docs").mkdir()
    for name in modules:
        with open(os.path.join(sysconfig.get_paths()["stdlib"], f"{name}.py"),
                  encoding="utf-8") as f:
            (root / "docs" / f"{name.replace('/', '_')}.txt").write_text(f.read())
    python("prepare.py", f"--dataset={root / 'docs'}", f"--tokenizer={tokenizer}",
           "--val_docs=1", f"--out_dir={root / 'data'}", "--num_proc=1", env=env)
    return str(root / "data")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory, session_env):
    """A few standard-library modules, prepared with the byte tokenizer."""
    return stdlib_data(tmp_path_factory.mktemp("corpus"),
                       ("os", "argparse", "json/decoder", "shutil", "textwrap"), "byte",
                       session_env)


@pytest.fixture
def small_disk(tmp_path, request):
    """A real 1 MiB file system: room for two checkpoints of the TINY model, not for three.
    Another size through indirect parametrization: its tmpfs size, as "64k"."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    size = getattr(request, "param", "1m")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                   check=True)
    yield str(mount)
    subprocess.run(["umount", str(mount)], check=True)
