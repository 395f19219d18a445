"""Train a GPT with DistributedDataParallel or FSDP2 (parallel=fsdp), on one process or many.

  python train.py config/quickstart.py                       # one process, CPU or one GPU
  torchrun --standalone --nproc_per_node=8 train.py config/owt.py --batch_size=16
  srun python train.py config/owt.py                         # one SLURM task per GPU

Every key, its default and its type is in TrainConfig (ddpgpt/settings.py; `python train.py
--help` lists them); config files and --key=value arguments override them. The data position
is a number of global samples (ddpgpt/data.py), so a run resumes exactly, also on another
world size with the same global batch.

The file reads in the order a run goes: main() starts it in a launch session (ddpgpt/launch.py:
every start-up check runs on every rank before any step, so bad input ends all ranks with one
message), make_run() builds what the loop works with, then the training loop, the evaluation
and checkpoint between steps, one optimizer step, and what a step reports.
"""
import dataclasses
import logging
import math
import os
import signal
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple

from ddpgpt import configurator, cpu, signals
from ddpgpt.settings import SPIKE_WINDOW, TrainConfig

cpu.wait_passively()  # before torch is imported
signals.end_at_once_while_importing("train.py")  # one line, not a traceback from each rank
if __name__ == "__main__":
    configurator.end_now_if_unreadable(TrainConfig, sys.argv[1:], "train.py")

import torch  # noqa: E402  (the imports that take seconds come after)
import torch.distributed as dist  # noqa: E402

from ddpgpt import (arch, checkpoint, data, errors, evaluation, launch, loader,  # noqa: E402
                    memplan, metrics, network, optim, parallel, profiling, runtime, schedule,
                    sources, watchdog, weights)
from ddpgpt.errors import UserError
from ddpgpt.model import GPT, GPTConfig
from ddpgpt.state import Saved, TrainState

log = logging.getLogger("ddpgpt.train")

SPIKE_WARMUP = 20  # fewer applied steps than this: no spike is judged (settings.SPIKE_WINDOW)
# a spread below this share of the mean counts as this share: after a flat history (lr=0,
# say) any rise would be infinitely many standard deviations
SPIKE_MIN_SPREAD = 1e-3
NAN_STREAK = 10  # nan_policy='skip' gives up after this many non-finite steps in a row
OOM_STEPS = 3  # an out-of-memory error in these is the configuration's, and explained


@dataclass
class Run:
    """What the training loop works with, made once by make_run()."""
    cfg: TrainConfig
    ranks: runtime.Ranks
    device: str
    # one set of weights, three handles: parallel.Wrapped's
    model: torch.nn.Module
    eval_model: Callable
    train_model: Callable
    optimizer: Any  # a torch.optim.AdamW, or optim.MuonAdamW
    saver: checkpoint.Saver
    precision: runtime.Precision
    state: TrainState  # where the run is, and what a checkpoint keeps besides the tensors
    splits: dict  # {split: data.Mixture}
    evaluation: evaluation.Evaluation
    batches: Iterator  # this rank's micro-batches, from the data position on
    metrics: metrics.Metrics
    micro_steps: int  # this rank's per optimizer step
    flops_per_step: int  # of the model on the global batch, forward and backward
    peak: Any  # the device's peak FLOP/s, for MFU; None when unknown


class StartUp(NamedTuple):
    """What start_up() found, on the CPU, before any rank takes a step."""
    cfg: TrainConfig  # the settings as trained
    start: weights.Start
    meta: dict
    splits: dict
    identity: dict
    model: torch.nn.Module  # its weights loaded
    evaluation: evaluation.Evaluation


# ---- start-up ----

def main(argv):
    cfg, given = configurator.parse_given(TrainConfig, argv, "train.py")
    run = None  # once made: a rank that is lost says where the run stands (standing)
    # rank 0 holds out_dir's lock (and tensorboard_dir's) for the run: a second run there
    # would delete this one's checkpoints and interleave its metrics
    with launch.session("train.py", cfg.device, cfg.backend, cfg.dist_timeout_s, stops=True,
                        watch=(cfg.out_dir, cfg.hang_timeout_s, cfg.startup_timeout_s),
                        locks=[(cfg.out_dir, None), *metrics.tensorboard_locks(cfg)],
                        standing=lambda: standing(cfg, run)) as s:
        found = launch.start(s, lambda: start_up(cfg, given, s.ranks, s.device))
        if cfg.network_check != "off" and s.ranks.world_size > 1:
            launch.start(s, lambda: network.check(s.ranks, s.device, cfg.network_min_gbps,
                                                  cfg.network_check == "stop",
                                                  cfg.network_check != "auto"))
        try:  # the first forward and backward may be DDP's bucket pass or the first evaluation
            run = make_run(s, found)
            first = run.state.iter_num
            train(run, s.stops)
        except torch.OutOfMemoryError as e:
            if run is not None and run.state.iter_num >= first + OOM_STEPS:
                raise
            memory = torch.cuda.get_device_properties(s.device).total_memory
            raise UserError(memplan.out_of_memory(found.cfg, s.ranks.world_size, memory, e)) \
                from None
    return 0


def standing(cfg, run):
    """(where the run is, how to go on from there), for a rank that lost another one."""
    if run is None:
        return "in start-up, before the first step", (
            "Nothing was trained: run the same command again (torchrun --max-restarts=N does "
            "so by itself).")
    newest = checkpoint.list_checkpoints(cfg.out_dir)
    saved = f"The newest checkpoint is {newest[0]}" if newest else \
        f"{cfg.out_dir} holds no checkpoint yet, so the run starts over"
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) - int(
        os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if cfg.init_from == "scratch" and not newest:
        how = ("run the same command again, or let torchrun do so (--max-restarts=N); "
               "--init_from=auto would resume from the checkpoints it saves from then on")
    elif cfg.init_from == "scratch":
        refused = (f"torchrun's restart ({restarts} left of --max-restarts) will be refused, "
                   f"as init_from='scratch' is in an out_dir that holds checkpoints; "
                   if restarts > 0 else "")
        how = f"{refused}run the same command with --init_from=auto, which resumes from it"
    elif restarts > 0:
        how = (f"torchrun restarts the run by itself ({restarts} restart(s) left of "
               f"--max-restarts) and init_from={cfg.init_from!r} resumes from it")
    else:
        how = (f"run the same command again (init_from={cfg.init_from!r} resumes from it), "
               f"or let torchrun do so: torchrun --max-restarts=N")
    return f"at iter {run.state.iter_num}", f"{saved}: to go on from there, {how}."


def start_up(cfg, given, ranks, device):
    """StartUp: the settings as trained, the data, the weights to start from (a checkpoint,
    GPT-2's, or none) and the model, each checked. Runs no collective, so that every rank gets
    to agree (launch.start) with its error, if any."""
    cfg.micro_steps(ranks.world_size)  # the global batch must share out over the ranks
    parallel.check(cfg, runtime.precision(cfg.dtype, device).dtype)
    if cfg.tensorboard_log and ranks.master:
        metrics.import_tensorboard()  # tensorboard imports, before any rank takes a step
    cfg, data_sources = sources.of(cfg, given)
    meta = sources.read_meta(data_sources)
    start = weights.for_training(cfg, given, meta, in_parts=parallel.sharded(cfg, ranks))
    if start.resume is None and ranks.master:
        metrics.refuse_another_runs_events(cfg)
    if cfg.profile_steps:
        profiling.folder(cfg.out_dir)  # every rank writes its trace there
    # the configuration says what is trained (the architecture of the weights resumed or
    # loaded, the vocab_size that 0 meant), so that its log and checkpoints do not lie
    cfg = dataclasses.replace(cfg, **arch.architecture(start.args))
    splits = sources.open_splits(data_sources, cfg.block_size, cfg.vocab_size, mode=cfg.sampling)
    identity = sources.identity(splits)
    if start.resume is not None:
        weights.check_resume(cfg, start.resume, meta, identity, len(data_sources))
    torch.manual_seed(cfg.seed)
    # the loss over the tokenizer's ids, or as the resumed checkpoint's was (state.Saved)
    model = GPT(GPTConfig(**start.args), arch.n_tokens(meta) if start.resume is None else
                Saved.of(start.resume).scored_ids)
    if cfg.proj_init == "zero":  # a resumed checkpoint's weights replace these
        model.zero_projections()
    if start.weights is not None:  # GPT-2's: a checkpoint's are resumed with its state
        model.load_state_dict(start.weights)
    if cfg.optimizer == "muon":  # its patterns checked here, before any collective
        optim.muon_parameters(model, cfg.muon_params)
    checkpoint.check_room(cfg.out_dir, model, cfg.ema_tail > 0)
    ev = evaluation.for_training(cfg, splits, meta, cfg.vocab_size)
    return StartUp(cfg, start, meta, splits, identity, model, ev)


def make_run(s, found):
    """The Run, once every rank sees the same data: the model on its device, in DDP or sharded
    (parallel.py) with several ranks; the optimizer and the training state (state.py) of a
    fresh run, or as the checkpoint left them (checkpoint.resume); this rank's batches from
    there; the saver of its checkpoints."""
    cfg, ranks, device = found.cfg, s.ranks, s.device
    launch.start(s, lambda: sources.check_same_on_all_ranks(
        launch.gather(found.identity, ranks.world_size), cfg.data_dir))
    log.info(f"configuration:\n{configurator.describe(cfg)}")
    precision = runtime.precision(cfg.dtype, device)
    model, eval_model, train_model = parallel.wrap(found.model, cfg, ranks, device, precision)
    optimizer = optim.make(cfg, model, runtime.device_type(device))
    state = TrainState(found.start.args, found.meta, found.identity, cfg.global_batch,
                       found.model.n_tokens)
    resume = found.start.resume
    if resume is not None:
        checkpoint.resume(resume, model, optimizer, precision.scaler, state)
    micro_steps = cfg.micro_steps(ranks.world_size)
    log.info(f"world size {ranks.world_size}, device {device}, dtype {precision.dtype}, "
             f"{model.get_num_params() / 1e6:.2f}M parameters, global batch {cfg.global_batch} x "
             f"{cfg.block_size} tokens (gradient_accumulation_steps="
             f"{cfg.gradient_accumulation_steps} / world size {ranks.world_size} = {micro_steps} "
             f"micro-step{'s' * (micro_steps != 1)} of {cfg.batch_size} per rank)")
    schedule.note_an_unfinished_decay(cfg)
    sources.log_train(found.splits["train"], cfg.max_iters * cfg.global_batch)
    batches = loader.rank_batches(
        found.splits["train"], block_size=cfg.block_size, batch_size=cfg.batch_size,
        micro_steps=micro_steps, rank=ranks.rank, world_size=ranks.world_size, seed=cfg.seed,
        mode=cfg.sampling, start_step=state.samples // cfg.global_batch, device=device,
        vocab_size=cfg.vocab_size)
    start = metrics.start_row(state.iter_num, resume is not None, cfg.init_from,
                              ranks.world_size)  # opens this run's rows in metrics.jsonl
    return Run(cfg=cfg, ranks=ranks, device=device, model=model, eval_model=eval_model,
               train_model=train_model, optimizer=optimizer, saver=saver(cfg, ranks, model),
               precision=precision, state=state, splits=found.splits, batches=batches,
               evaluation=found.evaluation, metrics=metrics.open_metrics(cfg, ranks.master, start),
               micro_steps=micro_steps, peak=runtime.peak_flops(device),
               flops_per_step=model.flops_per_token() * cfg.global_batch * cfg.block_size)


def saver(cfg, ranks, model):
    """The run's checkpoint.Saver: in the background with async_save, where this host has
    memory for the copy of what this rank writes (the whole state under ddp, on rank 0; its
    shard of it under fsdp) with as much to spare, else with a note."""
    n_bytes = checkpoint.size(model, cfg.ema_tail > 0) // (
        ranks.world_size if parallel.sharded(cfg, ranks) else 1)
    background = cfg.async_save and checkpoint.host_has_room(n_bytes, ranks)
    if cfg.async_save and not background:
        log.info(f"note: async_save: this host has too little memory for the copy of a checkpoint "
                 f"(about {n_bytes / 2**30:.1f} GiB per writing rank, and as much to spare): the "
                 f"saves are written before training goes on")
    return checkpoint.Saver(cfg, ranks, model, background)


# ---- the training loop ----

def train(run, stop_signals):
    """The training loop; then the save in the background, if any, is written before the run
    ends (and out_dir's lock is let go), however the loop ended."""
    with run.saver:
        try:
            loop(run, stop_signals)
        finally:
            if run.saver.pending is not None:  # the saver's exit waits for it
                watchdog.beat(run.saver.iter_num, doing="checkpoint save")  # a whole limit
    watchdog.stop()
    metrics.close(run.metrics)


def loop(run, stop_signals):
    """Evaluate (and save) every eval_interval steps and at the end; between, one optimizer
    step per iteration. A signal stops the run at one step, agreed by all ranks, and saves."""
    cfg, state = run.cfg, run.state
    start_iter = state.iter_num
    history = deque(maxlen=SPIKE_WINDOW)  # (loss, gradient norm) of the last applied steps
    t_last, skipped = time.perf_counter(), 0  # non-finite steps skipped in a row
    profiled, profiler = profiling.window(cfg.profile_steps, cfg.max_iters), None
    while True:
        if cfg.ema_tail and state.iter_num >= cfg.max_iters:
            optim.use_average(run.optimizer)
            log.info(f"the weights are now their average over the last "
                     f"{cfg.max_iters - optim.tail_start(cfg)} steps (ema_tail): the run's end, "
                     f"evaluated, saved and exported as such")
        if state.iter_num % cfg.eval_interval == 0 or \
                state.iter_num >= cfg.max_iters or cfg.eval_only:
            evaluate_and_save(run, may_save=state.iter_num > start_iter)
            t_last = time.perf_counter()
            watchdog.beat(state.iter_num)
        if cfg.eval_only or state.iter_num >= cfg.max_iters:
            break
        if state.iter_num == start_iter:
            signals.steps_begin()  # nothing to save before: a stop signal ended the run
        if profiled and state.iter_num == max(profiled[0], start_iter) <= profiled[1]:
            profiler = profiling.start(run.device, cfg.profile_memory)
        step = train_step(run, history, stop_signals)
        if profiler and (state.iter_num == profiled[1] or step.stop):
            profiling.write(profiler, cfg.out_dir, run.ranks.rank, profiled, run.device,
                            cfg.profile_memory)
            profiler = None
        t_now = time.perf_counter()
        dt, t_last = t_now - t_last, t_now
        report_step(run, step, dt, first=state.iter_num == start_iter)
        skipped = skipped + 1 if step.row.get("skipped") == "non-finite" else 0
        if skipped:
            check_skipping(run, skipped)
        state.iter_num += 1
        state.samples += cfg.global_batch
        watchdog.beat(state.iter_num, step_s=dt)
        run.saver.check()  # a save in the background that failed ends the run
        if step.stop:
            log.info(f"stopping at iter {state.iter_num}: signal received, saving a checkpoint")
            if signal.SIGHUP in stop_signals and "TORCHELASTIC_RUN_ID" in os.environ:
                log.info(signals.HANGUP)
            save(run, last=True)
            log.info(f"interrupted at iter {state.iter_num}; resume with --init_from=resume")
            errors.say_torchrun_reports_next()
            break


def evaluate_and_save(run, may_save):
    """The evaluation at this iter, logged and recorded, and a checkpoint when it is one to
    keep (not the one just resumed from)."""
    cfg, state = run.cfg, run.state
    autocast = run.precision.autocast
    watchdog.beat(state.iter_num, doing="evaluation")  # a whole limit of its own
    results = evaluation.losses(run.eval_model, run.evaluation, run.ranks, autocast, run.device)
    if run.evaluation.hellaswag is not None and state.iter_num % cfg.hellaswag_interval == 0:
        results.update(evaluation.hellaswag_scores(run.model, run.evaluation, run.ranks,
                                                   autocast, run.device))
    log.info(evaluation.describe(state.iter_num, results))
    metrics.record(run.metrics, {"iter": state.iter_num, **results})
    improved = results["val_loss"] < state.best_val
    state.best_val = min(state.best_val, results["val_loss"])  # a NaN leaves it
    if not all(map(math.isfinite, results.values())):
        kept = "the previous ones are kept" if checkpoint.list_checkpoints(cfg.out_dir) else \
            f"and there is none in {cfg.out_dir} yet"
        log.warning(f"warning: non-finite evaluation loss at iter {state.iter_num}: no "
                    f"checkpoint written, {kept}")
    elif may_save and (improved or cfg.always_save_checkpoint or state.iter_num >= cfg.max_iters):
        save(run, last=state.iter_num >= cfg.max_iters)


def save(run, last=False):
    """A checkpoint of the run as it is, by the ranks that write (checkpoint.Saver): in the
    background with async_save, but a run's last save is written before the run goes on."""
    # a whole limit of its own, for the save and the wait for the one before, if still writing
    watchdog.beat(run.state.iter_num, doing="checkpoint save")
    run.saver.save(checkpoint.contents(run.model, run.optimizer, run.precision.scaler, run.state,
                                       run.cfg), last=last)


def check_skipping(run, skipped):
    """nan_policy='skip' skips a bad batch; it cannot mend weights that are no longer finite
    (an applied step overflowed them), nor a run whose every batch is now non-finite: such a
    run would skip to its end and save nothing."""
    finite = parallel.all_finite(run.model)
    if finite and skipped < NAN_STREAK:
        return
    why = ("the weights themselves are no longer finite" if not finite else
           f"{skipped} steps in a row had a non-finite loss or gradient norm")
    saved = checkpoint.list_checkpoints(run.cfg.out_dir)
    where = (f"The last checkpoint is {saved[0]}: resume from it (--init_from=resume)" if saved
             else f"There is no checkpoint in {run.cfg.out_dir} yet: start again")
    raise UserError(f"nan_policy='skip' cannot recover at iter {run.state.iter_num}: {why}, "
                    f"so every step from here on would be skipped and nothing saved. {where} "
                    f"with a lower learning_rate, grad_clip=1.0 or dtype=bfloat16.")


# ---- one optimizer step ----

class Step(NamedTuple):
    row: dict  # for metrics.jsonl
    stop: bool  # a rank was signalled to stop
    alone: runtime.Stopwatch  # this rank's time in the step before waiting for the others
    data_wait_s: float  # its seconds waiting for data


def train_step(run, history, stop_signals):
    """One optimizer step over the global batch: this rank's micro-steps (forward_backward),
    the gradients unscaled and clipped, the step applied unless it must not be (step_problem),
    then what it reports, while the device runs it."""
    cfg, model, optimizer, scaler = run.cfg, run.model, run.optimizer, run.precision.scaler
    iter_num, samples = run.state.iter_num, run.state.samples
    lr = optim.set_lr(optimizer, cfg, iter_num)
    torch.manual_seed(cfg.seed + 7919 * run.ranks.rank + 104729 * iter_num)  # dropout resumes
    loss_sum, data_wait_s, alone = forward_backward(
        run.train_model, run.batches, run.micro_steps, run.precision,
        cfg.reduce_every_micro_step, run.device)
    scaler.unscale_(optimizer)
    grad_norm = parallel.clip_grad_norm(model, cfg.grad_clip or math.inf)
    loss, grad_norm, stop = share_step_results(loss_sum, grad_norm, stop_signals,
                                               run.ranks.world_size)
    problem = step_problem(cfg, loss, grad_norm, history, scaler.is_enabled())
    if problem is None:
        scaler.step(optimizer)
        optim.average(optimizer, cfg, iter_num)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

    # everything below is diagnostics, done while the device runs the optimizer step
    batch_fp = data.global_batch_fingerprint(samples // cfg.global_batch, cfg.global_batch,
                                             run.splits["train"], cfg.block_size, cfg.seed,
                                             cfg.sampling)
    if problem is not None:
        skip_or_stop(cfg, problem, iter_num, loss, batch_fp)
    elif math.isfinite(loss):
        history.append((loss, grad_norm))
    row = {"iter": iter_num, "loss": loss, "grad_norm": grad_norm, "lr": lr,
           "batch_fp": batch_fp, **({"skipped": problem} if problem else {})}
    return Step(row, stop, alone, data_wait_s)


def forward_backward(model, batches, micro_steps, precision, reduce_every_micro_step, device):
    """This rank's micro-steps of one optimizer step: (the summed loss on the device, seconds spent
    waiting for data, a Stopwatch of the time until the last backward, which waits for the other
    ranks in DDP: what this rank alone took). The gradients accumulate in the parameters."""
    loss_sum, data_wait, alone = 0.0, 0.0, runtime.Stopwatch(device)
    for micro_step in range(micro_steps):
        # the gradients are reduced over the ranks in the last micro-step's backward only
        parallel.sync_gradients(model, micro_step == micro_steps - 1 or reduce_every_micro_step)
        t = time.perf_counter()
        x, y = next(batches)
        data_wait += time.perf_counter() - t
        with precision.autocast:
            # the logits dropped at once: kept until the next micro-step they would be
            # batch_size x block_size x vocab_size numbers more through the backward
            loss = model(x, y)[1] / micro_steps
        alone.stop()  # at each micro-step: the last one's counts
        precision.scaler.scale(loss).backward()
        loss_sum = loss_sum + loss.detach().float()
    return loss_sum, data_wait, alone


def share_step_results(loss_sum, grad_norm, stop_signals, world_size):
    """(global mean loss, gradient norm, whether any rank was signalled to stop) in one small
    all-reduce and one transfer to the host: the step's only host-device synchronisation,
    so the device is never left idle waiting on Python mid-step."""
    shared = torch.stack([loss_sum, grad_norm.float(),
                          torch.full_like(loss_sum, float(bool(stop_signals)))])
    if world_size > 1:
        dist.all_reduce(shared)  # a sum; the gradient norm is the same on every rank
    loss, norm, stops = shared.tolist()
    return loss / world_size, norm / world_size, stops > 0


def step_problem(cfg, loss, grad_norm, history, fp16):
    """Why this step must not be applied, or None. In float16 an overflow is normal, and the
    GradScaler's to skip. A spike is judged against the last SPIKE_WINDOW applied steps
    (llm.c's idea), once there are SPIKE_WARMUP of them."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        return None if fp16 else "non-finite"
    if cfg.spike_policy == "off" or len(history) < SPIKE_WARMUP:
        return None
    for name, value, seen in (("loss", loss, [h[0] for h in history]),
                              ("gradient norm", grad_norm, [h[1] for h in history])):
        mean = statistics.fmean(seen)
        spread = max(statistics.pstdev(seen), SPIKE_MIN_SPREAD * abs(mean))
        if spread > 0 and value > mean + cfg.spike_zscore * spread:
            return (f"{name} spike: {value:.4g}, {(value - mean) / spread:.1f} standard "
                    f"deviations above the last {len(seen)} steps' {mean:.4g}")
    return None


def skip_or_stop(cfg, problem, iter_num, loss, batch_fp):
    """A step that was not applied: stop (nan_policy's default), or go on with the next one,
    whose data is what it would have been."""
    if problem != "non-finite":
        log.warning(f"warning: {problem} at iter {iter_num} (batch_fp {batch_fp}): step skipped "
                    f"(spike_policy='skip')")
        return
    what = f"non-finite loss {loss} or gradient norm at iter {iter_num} (batch_fp {batch_fp})"
    if cfg.nan_policy == "stop":
        raise UserError(f"{what}: training stopped without saving, so the last checkpoint is "
                        f"still good. Try a lower learning_rate, grad_clip=1.0 or "
                        f"dtype=bfloat16, and check the data at that batch; nan_policy='skip' "
                        f"skips such steps.")
    log.warning(f"warning: {what}: step skipped (nan_policy='skip')")


# ---- what a step reports ----

def report_step(run, step, dt, first):
    """A step's timings added to its row, on the console every log_interval steps with every
    rank's numbers (a rank that stays the slowest named, judged from the log steps after a
    run's first, whose one-time work differs between ranks), and the row in metrics.jsonl (and
    wandb, and TensorBoard)."""
    cfg, row = run.cfg, step.row
    row.update(ms=dt * 1000, tok_per_s=cfg.global_batch * cfg.block_size / dt,
               data_wait=step.data_wait_s / dt)
    if run.peak:
        row["mfu"] = run.flops_per_step / dt / (run.peak * run.ranks.world_size)
    cuda = runtime.device_type(run.device) == "cuda"
    if cuda:  # the allocator's count: no synchronising
        row["peak_mem"] = torch.cuda.max_memory_allocated(run.device)
    if row["iter"] % cfg.log_interval == 0:
        row.update(metrics.rank_telemetry(step.alone.seconds(), step.data_wait_s,
                                          row.get("peak_mem"), run.device, run.ranks.world_size))
        metrics.log_step(row, run.peak)
        if not first:
            metrics.log_straggler(row, run.metrics.slowest)
    metrics.record(run.metrics, row)
    if cuda:  # each row's peak is its own step's (and any evaluation's since the last row),
        torch.cuda.reset_peak_memory_stats(run.device)  # so that a later step holding more shows


if __name__ == "__main__":
    sys.exit(errors.run(main, "train.py", sys.argv[1:]))
