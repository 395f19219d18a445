"""The optimizer and its learning-rate schedule, for train.py (and the Lightning example).

AdamW as nanoGPT sets it up: weight decay on the matrices (matmul weights, embeddings) only,
and the fused kernel on CUDA. The schedule is a linear warm-up, then cosine decay to min_lr,
or (wsd) warm-up, a stable phase and a cooldown.
"""
import inspect
import math

import torch


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
        cooldown = max(1, round(cfg.max_iters * cfg.cooldown_frac))
        done = min(1.0, max(0, it + 1 - (cfg.max_iters - cooldown)) / cooldown)
        return cfg.min_lr + (1 - math.sqrt(done)) * (cfg.learning_rate - cfg.min_lr)
    if it > cfg.lr_decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)
