"""Profiles of chosen steps (profile_steps): each rank's torch.profiler trace of them, and on CUDA
a memory snapshot (profile_memory), in out_dir/profile/. The steps outside run no profiler."""
import logging
import os
import re

from ddpgpt.errors import UserError

log = logging.getLogger(__name__)


def window(steps, max_iters):
    """(first, last) iter of profile_steps ('20-22', or '20'); None for ''."""
    if not steps:
        return None
    match = re.fullmatch(r"(\d+)(?:-(\d+))?", steps)
    first, last = (int(match[1]), int(match[2] or match[1])) if match else (0, -1)
    if first <= last < max_iters:
        return first, last
    raise UserError(f"profile_steps={steps!r} is not a window of this run's steps: give FIRST-LAST "
                    f"or one step, with FIRST <= LAST < max_iters={max_iters} (iters 0 to "
                    f"{max_iters - 1}), e.g. profile_steps=20-22.")


def folder(out_dir):
    """out_dir/profile, made: every rank writes its trace there."""
    path = os.path.join(out_dir, "profile")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot make {path} for profile_steps' traces ({e.strerror}): make "
                        f"out_dir writable, or leave profile_steps out.") from None
    return path


def start(device, memory):
    """A running profiler of the CPU's work and, on CUDA, the GPU's (and its memory's history)."""
    import torch  # here: settings.py reads window() before any script imports torch
    cuda = torch.device(device).type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU,
                  *[torch.profiler.ProfilerActivity.CUDA] * cuda]
    profiler = torch.profiler.profile(activities=activities, record_shapes=True)
    profiler.start()
    if memory and cuda:
        torch.cuda.memory._record_memory_history()
    return profiler


def write(profiler, out_dir, rank, steps, device, memory):
    """Stop profiling, and write this rank's trace (and memory snapshot) of iters steps."""
    import torch
    profiler.stop()
    stem = f"iters{steps[0]}-{steps[1]}"
    name = os.path.join(folder(out_dir), f"rank{rank}_{stem}")
    # a .pt.trace.json name, which TensorBoard's profiler view finds; Perfetto opens any
    profiler.export_chrome_trace(f"{name}.pt.trace.json")
    viewers = "https://ui.perfetto.dev, or TensorBoard's profiler view"
    if memory and torch.device(device).type == "cuda":
        torch.cuda.memory._dump_snapshot(f"{name}.memory.pickle")
        torch.cuda.memory._record_memory_history(enabled=None)
        viewers += "; the .memory.pickle files in https://pytorch.org/memory_viz"
    log.info(f"profiled {stem}: {os.path.join(out_dir, 'profile', f'rank*_{stem}')}.pt.trace.json,"
             f" a file per rank (open in {viewers})")
