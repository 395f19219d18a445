"""The optimizer and its learning-rate schedule, for train.py (and the Lightning example).

AdamW as nanoGPT sets it up: weight decay on the matrices (matmul weights, embeddings) only,
and the fused kernel on CUDA. The schedule is a linear warm-up, then cosine decay to min_lr,
or (wsd) warm-up, a stable phase and a cooldown.
"""
import inspect
import math
from types import SimpleNamespace

import torch

from ddpgpt.errors import UserError


def make_optimizer(model, weight_decay, learning_rate, betas, device_type):
    # decaying biases and LayerNorm gains just pulls them towards a degenerate zero
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    # the fused kernel is one launch for all parameters instead of several per tensor
    fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
    extra = dict(fused=True) if fused else dict()
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **extra)


def lr_at(cfg, it):
    """Linear warm-up, then cosine decay to min_lr at lr_decay_iters, then min_lr; or (wsd)
    the learning rate until the last cooldown_frac of max_iters, which decays as 1 - sqrt to
    min_lr at the last step, so a run can be extended by raising max_iters before then."""
    if not cfg.decay_lr:
        return cfg.learning_rate
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if cfg.lr_schedule == "wsd":
        start = cooldown_start(cfg)
        done = min(1.0, max(0, it + 1 - start) / (cfg.max_iters - start))
        return cfg.min_lr + (1 - math.sqrt(done)) * (cfg.learning_rate - cfg.min_lr)
    if it > cfg.lr_decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


def cooldown_start(cfg):
    """wsd: the iter where the cooldown begins, the last cooldown_frac of max_iters (a step
    at least)."""
    return cfg.max_iters - max(1, round(cfg.max_iters * cfg.cooldown_frac))


def check_extension(before, cfg, it, out_dir):
    """A wsd run resumed at iter it with another max_iters than its checkpoint's (before: the
    checkpoint's settings) must not be past the start of the old cooldown: there the learning
    rate has decayed, and the new schedule would jump it back up (or down)."""
    keys = ("decay_lr", "lr_schedule", "max_iters", "cooldown_frac", "warmup_iters",
            "learning_rate", "min_lr", "lr_decay_iters")
    if not all(k in before for k in keys):  # an older or nanoGPT checkpoint
        return
    old = SimpleNamespace(**{k: before[k] for k in keys})
    if not (old.decay_lr and old.lr_schedule == cfg.lr_schedule == "wsd") or \
            old.max_iters == cfg.max_iters or it < cooldown_start(old):
        return
    was, now = lr_at(old, it), lr_at(cfg, it)
    if math.isclose(was, now, rel_tol=1e-6):
        return
    raise UserError(
        f"the checkpoint in {out_dir} is at iter {it}, past the start of its wsd cooldown (iter "
        f"{cooldown_start(old)} of max_iters={old.max_iters}), where the learning rate decays "
        f"to min_lr: with max_iters={cfg.max_iters} it would jump from {was:.2e} to {now:.2e}. "
        f"A wsd run is extended by raising max_iters before its cooldown begins: resume from a "
        f"checkpoint saved before iter {cooldown_start(old)} (move the newer ckpt_*.pt out of "
        f"{out_dir}), or keep max_iters={old.max_iters}.")
