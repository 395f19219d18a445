"""plan.py, the memory plan, as a user runs it: its peak against the peak the same tracker
measures in real runs of the same settings on the CPU (benchmarks/memory_rank.py, under torchrun,
gloo; a 1-rank run as a plain process, as train.py runs on one), and its refusal of a GPU
memory that is not one."""
import dataclasses
import glob
import json
import shlex

import pytest
import torch

from conftest import fails, python, ranks_command, run, train_args

SMALL = ["--n_layer=2", "--n_head=4", "--n_embd=64", "--block_size=64", "--batch_size=4",
         "--vocab_size=512", "--gradient_accumulation_steps=4", "--device=cpu",
         "--dtype=float32"]
# a model whose peak is at Muon's step under ddp (its weights and optimizer state outweigh its
# activations), where each rank builds its owned updates and gathers every rank's: the plan
# counts those as rank 0 of 2 does, to the byte (planned as one rank they were 5% over)
STEP_BOUND = "n_embd=256+block_size=16+batch_size=1+vocab_size=64"
# (parallel, ranks, optimizer, arch, activation_checkpointing[+key=value...])
RUNS = [("ddp", 1, "adamw", "gpt2", "none"), ("ddp", 2, "muon", "modern", "none+" + STEP_BOUND),
        ("fsdp", 2, "adamw", "gpt2", "full"), ("fsdp", 2, "muon", "modern", "none"),
        ("ddp", 1, "adamw", "modern", "selective"),
        ("ddp", 1, "adamw", "gpt2", "full+loss_chunks=4")]
RTOL = 0.10  # the plan's peak against the measured one
RTOL_STEP = 0.01  # the same of STEP_BOUND: no activations to estimate


def settings(kind, optimizer, arch, recompute="none"):
    mode, *chunks = recompute.split("+")
    return [*SMALL, f"--parallel={kind}", f"--optimizer={optimizer}", f"--arch={arch}",
            f"--activation_checkpointing={mode}", *(f"--{c}" for c in chunks)]


@pytest.fixture(scope="module")
def measured(tmp_path_factory, session_env):
    """{run: rank 0's measured Plan} of each of RUNS, on real tensors (a run of 1 rank as a
    plain process: conftest.ranks_command)."""
    root = tmp_path_factory.mktemp("measured")
    found = {}
    for kind, n, optimizer, arch, recompute in RUNS:
        out = root / f"{kind}-{n}-{optimizer}-{arch}-{recompute}"
        run([*ranks_command(n), "-m", "benchmarks.memory_rank", str(out),
             *settings(kind, optimizer, arch, recompute)], session_env)
        with open(f"{out}.rank0.json") as f:
            found[kind, n, optimizer, arch, recompute] = json.load(f)
        assert len(glob.glob(f"{out}.rank*.json")) == n
    return found


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS, ids=["-".join(map(str, r[:4])) + "-" +
                                           r[4].replace(STEP_BOUND, "step") for r in RUNS])
def test_the_plans_peak_is_the_measured_one(run, measured, env):
    kind, n, optimizer, arch, recompute = run
    p = python("plan.py", *settings(kind, optimizer, arch, recompute), f"--world_size={n}",
               "--json", env=env)
    planned = json.loads(p.stdout)["plan"]
    assert planned["total"] == pytest.approx(measured[run]["peak"],
                                             rel=RTOL_STEP if STEP_BOUND in recompute else RTOL)
    if run == RUNS[0]:  # each plan says on stderr what it plans (then, past 10 s, its
        # micro-steps); stdout is the plan alone
        assert p.stderr.splitlines()[0] == ("planning 2 layers, --batch_size=4 --parallel=ddp "
                                            "--reduce_every_micro_step=False "
                                            "--activation_checkpointing=none --loss_chunks=1")
    assert planned["weights"] > 0 and planned["optimizer"] > 0 and planned["activations"] > 0


@pytest.mark.parametrize("value", ["-5GiB", "0GB", "80XB", "lots", "80", "1e400GiB", "0.5B"])
def test_a_gpu_memory_that_is_not_one_is_refused(value, env):
    """1e400GiB was an OverflowError; 0.5B was 0 bytes, then 'give --gpu_memory=80GiB'."""
    p = fails("plan.py", f"--gpu_memory={value}", env=env)
    assert f"plan.py: error: gpu_memory={value!r} is not a memory size: give a number and a " \
           f"unit that make 1 byte or more, e.g. --gpu_memory=80GiB" in p.stderr


def planned_as(monkeypatch, peak):
    """memplan, its plan() replaced by peak(cfg) bytes, activations all: plans in no time."""
    from ddpgpt import memplan
    monkeypatch.setattr(memplan, "plan", lambda cfg, *_: memplan.Plan(0, 0, 0, peak(cfg),
                                                                      peak(cfg), 0))
    return memplan


def small_config(*args):
    from ddpgpt import configurator
    from ddpgpt.settings import TrainConfig
    return configurator.parse(TrainConfig, [*SMALL, *args], "train.py")


# peak(batch_size) in bytes, and what plan.py says of the largest batch_size on 80 GiB
PEAKS = {"4 KiB a sequence from 1 to 2, then 256 MiB":
         (lambda b: 2**30 + (4096 * b if b <= 2 else 2**28 * b), "284"),
         "the same at every batch": (lambda b: 2**30, "128 or more"),
         "a byte a sequence": (lambda b: b, "1048576 or more"),
         "more than the GPU at one sequence": (lambda b: 2**40, "none")}


@pytest.mark.parametrize("peak, said", PEAKS.values(), ids=PEAKS)
def test_the_largest_batch_that_fits_is_what_the_plans_found_and_never_below_one(
        peak, said, monkeypatch):
    """The first case, extrapolated from 1 and 2 sequences, was 'the largest batch_size that
    fits: -2570603224' (--world_size=1000 --gradient_accumulation_steps=1000 --parallel=fsdp)."""
    import plan
    memplan = planned_as(monkeypatch, lambda cfg: peak(cfg.batch_size))
    cfg = small_config()
    fit = memplan.fit(cfg, {}, 1, "float32", 80 * 2**30, memplan.plan(cfg))
    assert plan.largest(fit) == said
    assert fit.largest_batch == 0 or peak(fit.largest_batch) <= fit.room
    assert fit.over_batch == 0 or peak(fit.over_batch) > fit.room


@pytest.mark.parametrize("dtype, advised", [("bfloat16", True), ("float16", False)])
def test_what_would_fit_is_what_train_py_takes_in_that_dtype(dtype, advised, monkeypatch):
    """fsdp does not train in float16 (what dtype='auto' is on a V100 or T4): it was advised."""
    memplan = planned_as(monkeypatch, lambda cfg: 2**20 if cfg.parallel == "fsdp" else 2**40)
    fixes = memplan.fixes(small_config(f"--dtype={dtype}"), {}, 2, dtype, 2**30, 0)
    assert any("--parallel=fsdp" in keys for keys, _ in fixes) == advised, fixes


def oom_command(cfg, gpu_memory):
    """The plan.py command that train.py's out-of-memory paragraph names, for cfg on 2 ranks."""
    from ddpgpt import memplan
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.\nmore")
    message = memplan.out_of_memory(cfg, 2, gpu_memory, error)
    assert message.startswith("out of memory in the first steps (torch: CUDA out of memory. "
                              "Tried to allocate 2.00 MiB.): this configuration does not fit "
                              f"this GPU (batch_size={cfg.batch_size}, "), message
    return shlex.split(message.split("would fit: ", 1)[1])


def test_train_py_names_plan_py_with_its_settings_whole():
    """On a GPU, train.py's out-of-memory paragraph names plan.py with the run's settings (the
    keys not at their defaults): they must read back as the same settings (this part of the
    GPU path runs on a CPU)."""
    from ddpgpt import configurator
    from ddpgpt.settings import PlanConfig, TrainConfig
    cfg = TrainConfig(data_dir="data/elsewhere", arch="modern", rope_theta=5e5, optimizer="muon",
                      parallel="fsdp", reduce_every_micro_step=True, backend="",
                      out_dir="out dir/with 'quotes'", vocab_size=320, dropout=0.1,
                      wandb_run_name="'quoted'")
    command = oom_command(cfg, 80 * 2**30)
    assert command[:2] == ["python", "plan.py"] and command[-1] == "--gpu_memory=81920MiB"
    back = configurator.parse(PlanConfig, command[2:], "plan.py")
    assert {f.name: getattr(back, f.name) for f in dataclasses.fields(cfg)} == \
        dataclasses.asdict(cfg)
    assert back.world_size == 2


@pytest.mark.slow
def test_an_out_of_memory_error_at_the_first_steps_names_the_plan_that_says_what_would_fit(env):
    """The command that paragraph names, run: the plan of a CPU run's settings on a GPU of
    7 MiB, which they do not fit, and what would."""
    from ddpgpt import configurator
    from ddpgpt.settings import TrainConfig
    cfg = configurator.parse(TrainConfig, settings("ddp", "adamw", "gpt2"), "train.py")
    p = python(*oom_command(cfg, 7 * 2**20)[1:], env=env)
    assert "on 2 ranks" in p.stdout and "does not fit; the largest batch_size that fits: 3" \
        in p.stdout, p.stdout
    assert "would fit: --parallel=fsdp (peak 5.8 MiB per rank)" in p.stdout
    assert "would fit: --activation_checkpointing=full (peak 4.8 MiB per rank)" in p.stdout
    assert "would fit: --batch_size=2 --gradient_accumulation_steps=8" in p.stdout


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_out_of_memory_before_the_first_step_is_explained_on_any_rank_count(nproc, corpus,
                                                                            tmp_path, env):
    """The first forward is where an oversized batch runs out: on 2 ranks DDP's gradient-bucket
    pass in the wrap, on 1 the iter-0 evaluation, both before the first step (each was a raw
    traceback on every rank)."""
    p = fails("tests/launch_out_of_memory.py", *train_args(corpus, tmp_path / "out"),
              "--max_iters=2", nproc=nproc, env=env)
    rank = " (rank 0)" * (nproc > 1)
    assert f"train.py: error{rank}: out of memory in the first steps (torch: CUDA out of memory. " \
           "Tried to allocate 2.00 GiB." in p.stderr and "--gpu_memory=81920MiB" in p.stderr, \
        p.stderr


@pytest.mark.parametrize("dtype, advised", [("bfloat16", True), ("float16", False)])
def test_what_no_one_change_makes_fit_is_sought_in_combinations(dtype, advised, monkeypatch):
    """A 4-layer model at 67 MiB on 2 ranks was told 'nothing planned here fits' while
    --parallel=fsdp --activation_checkpointing=full together fit; in float16 fsdp is refused."""
    memplan = planned_as(monkeypatch, lambda cfg: 2**20 if cfg.parallel == "fsdp" and
                         cfg.activation_checkpointing == "full" else 2**40)
    fixes = [keys for keys, _ in memplan.fixes(small_config(f"--dtype={dtype}"), {}, 2, dtype,
                                               2**30, 0)]
    assert ("--parallel=fsdp --activation_checkpointing=full" in fixes) == advised, fixes
    assert all("fsdp" not in keys for keys in fixes) or advised, fixes


def test_what_fits_only_in_smaller_micro_batches_with_the_leanest_settings_is_said(monkeypatch):
    """Nothing alone nor any pair at the same batch: the leanest settings in the largest
    micro-batch that fits and keeps the global batch (16 = 4 x 4 over 2 ranks)."""
    memplan = planned_as(monkeypatch, lambda cfg: 2**20 * cfg.batch_size if cfg.parallel ==
                         "fsdp" and cfg.loss_chunks == 8 else 2**40)
    fixes = memplan.fixes(small_config(), {}, 2, "float32", 3 * 2**20, 0)
    assert fixes == [("--parallel=fsdp --reduce_every_micro_step=True --activation_checkpointing="
                      "full --loss_chunks=8 --batch_size=2 --gradient_accumulation_steps=8",
                      "the same global batch")]


def test_nothing_fits_advises_fsdp_only_in_a_dtype_it_trains_in():
    import plan
    from ddpgpt import configurator, memplan
    from ddpgpt.settings import PlanConfig
    cfg = configurator.parse(PlanConfig, [*SMALL, "--dtype=float16", "--world_size=2"], "plan.py")
    said = plan.describe(cfg, {"n_layer": 2, "n_embd": 64}, "float16", memplan.Plan(
        0, 0, 0, 2**40, 2**40, 0), 2**30, memplan.Fit(2**29, False, 0, 1, []))
    assert said.endswith("nothing planned here fits: more ranks with parallel=fsdp in float32 "
                         "or bfloat16, or a smaller model"), said


def test_a_slow_plan_says_when_each_micro_step_ended(monkeypatch, caplog):
    """A deep model's plan (n_layer=10000) printed nothing for minutes."""
    import logging

    from ddpgpt import arch, memplan
    monkeypatch.setattr(memplan, "PROGRESS_S", -1)
    cfg = small_config()
    with caplog.at_level(logging.INFO, logger="ddpgpt"):
        memplan.plan(cfg, arch.model_args(cfg, None), 1, "float32")
    steps = [m.split(":")[0] for m in caplog.messages if m.startswith("  step")]
    assert steps == ["  step 1, micro-step 1", "  step 1, micro-step 2", "  step 2, micro-step 1",
                     "  step 2, micro-step 2"], caplog.messages
