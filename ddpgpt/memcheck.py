"""train.py's side of the memory plan, on a GPU: plan.py for the run's settings, started by rank
0 in the background at start-up (a process of its own: the plan needs a fake process group, and
this one is in the run's real one), its peak logged beside what the run measures after its first
steps, and an out-of-memory error at the first steps turned into one paragraph that names the
plan's numbers and the keys that would fit.
"""
import dataclasses
import json
import logging
import os
import subprocess
import sys

import torch

from ddpgpt.errors import UserError
from ddpgpt.memplan import size

log = logging.getLogger(__name__)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST_STEPS = 3  # an out-of-memory error in these is the configuration's, and explained
WAIT_S = 600  # for the plan, when an out-of-memory error needs its numbers


class Check:
    """plan.py running for this run, and what it printed once it has finished."""

    def __init__(self, argv, env):
        self.argv = argv
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.found, self.logged = None, False

    def result(self, wait_s=0):
        """plan.py's JSON once it has finished (None before, or if it failed)."""
        if self.found is None and (wait_s or self.proc.poll() is not None):
            try:
                out, err = self.proc.communicate(timeout=wait_s or None)
            except subprocess.TimeoutExpired:
                return None
            self.found = json.loads(out) if self.proc.returncode == 0 else {"error": err}
        return self.found if self.found and "error" not in self.found else None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start(cfg, ranks, device, dtype):
    """plan.py of the run's settings (the architecture and vocab_size as trained) on its world
    size and this GPU's memory, on rank 0 of a CUDA run; None elsewhere. It runs on the CPU:
    it is given no GPU."""
    if torch.device(device).type != "cuda" or not ranks.master:
        return None
    argv = [sys.executable, os.path.join(ROOT, "plan.py"), *settings_args(cfg),
            f"--dtype={dtype!r}", f"--world_size={ranks.world_size}", "--json",
            f"--gpu_memory={torch.cuda.get_device_properties(device).total_memory}B"]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return Check(argv, {**env, "CUDA_VISIBLE_DEVICES": ""})


def settings_args(cfg):
    """--key=value arguments that give plan.py the settings of cfg, every key."""
    return [f"--{f.name}={getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg)]


def log_against_measured(check, device):
    """Once the plan is in: its peak beside torch.cuda.max_memory_allocated so far."""
    if check is None or check.logged or check.result() is None:
        return
    check.logged = True
    planned = check.result()["plan"]["total"]
    measured = torch.cuda.max_memory_allocated(device)
    log.info(f"memory: plan.py's peak {size(planned)} per rank; measured (max_memory_allocated "
             f"so far) {size(measured)}, {measured / planned:.2f} x the plan")


def out_of_memory(check, cfg, world_size, error):
    """The UserError to raise for an out-of-memory error at the first steps: one paragraph
    with the plan's numbers and the keys that would fit (on rank 0, which ran the plan)."""
    first = str(error).strip().splitlines()[0]
    again = (f"python plan.py <your config and keys> --world_size={world_size} tries others "
             f"before a run.")
    found = check.result(WAIT_S) if check is not None else None
    if found is None:
        return UserError(f"out of memory in the first steps (torch: {first}): this "
                         f"configuration does not fit this GPU (batch_size={cfg.batch_size}, "
                         f"parallel={cfg.parallel}). {again}")
    planned, fit = found["plan"], found["fit"]
    fixes = "; ".join(f"{keys} ({why})" for keys, why in fit["fixes"]) or \
        "nothing planned on these ranks (fsdp, activation checkpointing, a smaller batch_size): " \
        "more ranks with parallel=fsdp, or a smaller model"
    return UserError(
        f"out of memory in the first steps (torch: {first}). The plan of this run puts one "
        f"rank's peak at {size(planned['total'])} (weights {size(planned['weights'])}, "
        f"gradients {size(planned['gradients'])}, optimizer state "
        f"{size(planned['optimizer'])}, activations {size(planned['activations'])} at "
        f"batch_size={cfg.batch_size}), against {size(fit['room'])} usable on this GPU; the "
        f"largest batch_size that fits: {fit['largest_batch'] or 'none'}. What would fit: "
        f"{fixes}. {again}")
