"""The learning-rate schedule: a linear warm-up, then cosine decay to min_lr (nanoGPT's), or
(lr_schedule='wsd') warm-up, a stable phase and a cooldown over the last cooldown_frac of
max_iters, which lets a run be extended by raising max_iters before the cooldown begins. It is
learning_rate's; optim.set_lr sets every group's rate from it."""
import logging
import math
from types import SimpleNamespace

from ddpgpt.errors import UserError

log = logging.getLogger(__name__)


def cooldown_start(cfg):
    """wsd: the iter where the cooldown begins, the last cooldown_frac of max_iters (a step
    at least)."""
    return cfg.max_iters - max(1, round(cfg.max_iters * cfg.cooldown_frac))


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


def note_an_unfinished_decay(cfg):
    """A cosine schedule that max_iters cuts short ends with the learning rate well above
    min_lr, which nothing else would say (nanoGPT's configs set lr_decay_iters = max_iters)."""
    if cfg.decay_lr and cfg.lr_schedule == "cosine" and not cfg.eval_only and \
            cfg.warmup_iters < cfg.max_iters < cfg.lr_decay_iters:
        log.info(f"note: max_iters={cfg.max_iters} ends before lr_decay_iters="
                 f"{cfg.lr_decay_iters}: the last step's learning rate is "
                 f"{lr_at(cfg, cfg.max_iters - 1):.3g}, not min_lr={cfg.min_lr:g}; to decay to "
                 f"min_lr by the end, set --lr_decay_iters={cfg.max_iters}")


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
