"""The memory plan of a training run, before it: per rank, the weights, gradients, optimizer
state and activations at the peak of its first steps, and with a GPU's memory, whether it fits,
the largest batch_size that does and which keys would make it fit.

  python plan.py config/owt.py --world_size=8 --gpu_memory=40GiB
  python plan.py config/owt.py --world_size=8 --parallel=fsdp --batch_size=32

It takes train.py's settings (a config file and --key=value; `python plan.py --help` lists
them) and three of its own: world_size, gpu_memory and json. Nothing is allocated: the steps
run on fake tensors, counted by torch's memory tracker (ddpgpt/memplan.py says how, and what it
leaves out). The model is the settings' (a resumed checkpoint's architecture is not read).
"""
import dataclasses
import json
import sys

from ddpgpt import configurator, errors, logs
from ddpgpt.settings import PlanConfig, parse_memory


def main(argv):
    cfg = configurator.parse(PlanConfig, argv, "plan.py")  # before torch's import (seconds)
    logs.setup(stream=sys.stderr)  # each plan's progress line; stdout is the plan's
    import torch

    from ddpgpt import arch, memplan, parallel
    gpu_memory = parse_memory(cfg.gpu_memory) if cfg.gpu_memory else 0
    if not cfg.gpu_memory and cfg.device != "cpu" and torch.cuda.is_available():
        gpu_memory = torch.cuda.get_device_properties(0).total_memory  # this machine's first GPU
    # dtype='auto' on the planned device: bfloat16 on a GPU (the GPUs worth planning for have
    # it), float32 on a CPU
    dtype = cfg.dtype if cfg.dtype != "auto" else \
        "bfloat16" if cfg.device != "cpu" and gpu_memory else "float32"
    parallel.check(cfg, dtype)
    train_cfg = dataclasses.replace(cfg, dtype=dtype)  # still a PlanConfig: plan() reads only
    model_args = arch.model_args(train_cfg, None)   # train.py's keys
    planned = memplan.plan(train_cfg, model_args, cfg.world_size, dtype)
    fit = memplan.fit(train_cfg, model_args, cfg.world_size, dtype, gpu_memory, planned) \
        if gpu_memory else None
    print(json.dumps({"plan": {**planned._asdict(), "total": planned.total}, "dtype": dtype,
                      "gpu_memory": gpu_memory, "fit": fit._asdict() if fit else None})
          if cfg.json else describe(cfg, model_args, dtype, planned, gpu_memory, fit))
    return 0


def describe(cfg, model_args, dtype, planned, gpu_memory, fit):
    from ddpgpt.memplan import GPU_HEADROOM, size
    lines = [f"memory plan: {cfg.arch} {model_args['n_layer']} layers x {model_args['n_embd']}, "
             f"parallel={cfg.parallel} on {cfg.world_size} rank{'s' * (cfg.world_size > 1)}, "
             f"{cfg.optimizer}, {dtype}, micro-batch {cfg.batch_size} x {cfg.block_size} tokens",
             "per rank, at the peak of the first two steps (torch's memory tracker, fake "
             "tensors):"]
    lines += [f"  {'optimizer state' if name == 'optimizer' else name:<16}"
              f"{size(getattr(planned, name)):>12}"
              for name in ("weights", "gradients", "optimizer", "activations", "peak")]
    if planned.ddp_buckets:
        lines.append(f"  + ddp's gradient buckets {size(planned.ddp_buckets)}: "
                     f"{size(planned.total)}")
    if fit is None:
        return "\n".join([*lines, "no GPU memory to compare with: give --gpu_memory=80GiB, say"])
    lines.append(f"on a GPU of {size(gpu_memory)} ({size(fit.room)} usable, {GPU_HEADROOM:.0%}):"
                 f" {'fits' if fit.fits else 'does not fit'}; the largest batch_size that fits: "
                 f"{largest(fit)}")
    lines += [f"  would fit: {keys} ({why})" for keys, why in fit.fixes]
    if not fit.fits and not fit.fixes:  # fsdp trains in float32 or bfloat16 (parallel.check)
        lines.append(f"  nothing planned here fits: more ranks with parallel=fsdp"
                     f"{' in float32 or bfloat16' * (dtype == 'float16')}, or a smaller model")
    return "\n".join(lines)


def largest(fit):
    """The largest batch_size that fits, or what the plans found of it."""
    return str(fit.largest_batch or "none") if fit.over_batch == fit.largest_batch + 1 else \
        f"{fit.largest_batch} or more" + f", under {fit.over_batch}" * bool(fit.over_batch)


if __name__ == "__main__":
    sys.exit(errors.run(main, "plan.py", sys.argv[1:]))
