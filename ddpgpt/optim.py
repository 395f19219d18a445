"""The optimizer and its learning-rate schedule, for train.py (and the Lightning example).

optimizer='adamw': AdamW as nanoGPT sets it up: weight decay on the matrices (matmul weights,
embeddings) only, and the fused kernel on CUDA. cautious_weight_decay: both optimizers decay a
weight only where its update has the weight's sign (muon.cautious_decay).

optimizer='muon': Muon (muon.py: torch.optim.Muon's update, computed once per matrix over the
ranks) for the matrices that muon_params names (by default every matrix in the blocks:
attention and MLP), and AdamW as above for everything else: the embeddings, the head, norms and
biases, which Muon is not made for (docs/training.md has its settings). The two optimizers are
stepped as one (MuonAdamW), so that train.py, float16's GradScaler and a checkpoint see one.

The schedule (schedule.py) is learning_rate's (AdamW's); Muon's follows it in proportion, from
muon_lr at the peak (set_lr).

ema_tail: an exponential moving average of the weights over the schedule's last steps (average),
which the run ends with (use_average). It is kept in the optimizer's state, as 'ema' beside each
parameter's moments, so that a checkpoint saves it and resumes it on any world size, ddp or fsdp,
as it does them."""
import collections.abc
import fnmatch
import inspect
import itertools
import math

import torch

from ddpgpt import checkpoint, schedule
from ddpgpt.errors import UserError
from ddpgpt.muon import DistributedMuon, cautious_decay, closure_loss, ns_dtype
from ddpgpt.parallel import local


def make(cfg, model, device_type):
    """train.py's optimizer for its settings (cfg: a TrainConfig)."""
    adamw_settings = (cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), device_type,
                      cfg.cautious_weight_decay)
    if cfg.optimizer == "adamw":
        return make_optimizer(model, *adamw_settings)
    matrices = muon_parameters(model, cfg.muon_params)
    muon = DistributedMuon(matrices, lr=cfg.muon_lr, momentum=cfg.muon_momentum,
                           weight_decay=cfg.muon_weight_decay,
                           ns_dtype=ns_dtype(cfg.muon_ns_dtype, device_type),
                           polar_express=cfg.muon_coefficients == "polar_express",
                           cautious=cfg.cautious_weight_decay, beta2=cfg.muon_beta2)
    taken = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in taken]
    return MuonAdamW(muon, adamw(rest, *adamw_settings))


def make_optimizer(model, weight_decay, learning_rate, betas, device_type, cautious=False):
    """AdamW over every parameter of the model."""
    return adamw(model.parameters(), weight_decay, learning_rate, betas, device_type, cautious)


def adamw(parameters, weight_decay, learning_rate, betas, device_type, cautious=False):
    # decaying biases and LayerNorm gains just pulls them towards a degenerate zero
    params = [p for p in parameters if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # the fused kernel is one launch for all parameters instead of several per tensor
    fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
    extra = dict(fused=True) if fused else dict()
    kind = CautiousAdamW if cautious else torch.optim.AdamW
    return kind(groups, lr=learning_rate, betas=betas, **extra)


class CautiousAdamW(torch.optim.AdamW):
    """torch's AdamW with cautious weight decay (muon.cautious_decay): an update has the sign
    of the new first moment (its denominator and bias corrections are positive), which the
    step reads before torch's, which then runs without decay. Its state and checkpoints are
    torch.optim.AdamW's. A class: torch's optimizer API is one."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        decays = [group["weight_decay"] for group in self.param_groups]
        for group in self.param_groups:
            for p in group["params"] if group["weight_decay"] else []:
                if p.grad is not None:
                    grad, moment = local(p.grad), self.state[p].get("exp_avg")
                    update = grad if moment is None else local(moment).lerp(
                        grad, 1 - group["betas"][0])
                    cautious_decay(local(p), update, group["lr"] * group["weight_decay"])
            group["weight_decay"] = 0.0
        try:
            super().step()
        finally:
            for group, decay in zip(self.param_groups, decays):
                group["weight_decay"] = decay
        return loss


def muon_parameters(model, patterns):
    """The parameters whose names match one of the comma-separated fnmatch patterns, in the
    model's order. Each pattern must match one at least (a typo would leave Muon out
    silently), and each must be a matrix: Muon orthogonalises 2-D updates only."""
    named = dict(model.named_parameters())  # a tied matrix once, by its first name
    tied = checkpoint.aliases(model)  # {a tied matrix's other name: its name in named}
    chosen = set()
    for pattern in filter(None, (p.strip() for p in patterns.split(","))):
        found = {name for name in named if fnmatch.fnmatchcase(name, pattern)}
        alias = next((name for name in tied if fnmatch.fnmatchcase(name, pattern)), None)
        if not found and alias is not None:
            raise UserError(
                f"muon_params={patterns!r}: {pattern!r} names {alias}, which is tied to "
                f"{tied[alias]}: one matrix, which the model's parameters name once, as "
                f"{tied[alias]}. The embedding and the output layer belong to AdamW in Muon's "
                f"recipe: leave it out (the default 'transformer.h.*.c_*.weight' does).")
        if not found:
            raise UserError(
                f"muon_params={patterns!r}: {pattern!r} matches no parameter of the model, "
                f"whose names are such as {', '.join(list(named)[:3])}: fix the pattern, or "
                f"use the default 'transformer.h.*.c_*.weight' (every matrix in the blocks).")
        chosen |= found
    if not chosen:
        raise UserError(f"muon_params={patterns!r} names no parameter for Muon: give patterns such "
                        f"as the default 'transformer.h.*.c_*.weight', or use optimizer='adamw'.")
    flat = [f"{name} {tuple(named[name].shape)}" for name in named
            if name in chosen and named[name].dim() != 2]
    if flat:
        raise UserError(
            f"muon_params={patterns!r} gives Muon {', '.join(flat)}, which "
            f"{'is not a matrix' if len(flat) == 1 else 'are not matrices'}: torch.optim.Muon "
            f"orthogonalises 2-D updates only, and norms and biases belong to AdamW. Narrow "
            f"the patterns to the matrices, e.g. the default 'transformer.h.*.c_*.weight'.")
    return [p for name, p in named.items() if name in chosen]


class MuonAdamW:
    """Muon and AdamW, stepped, zeroed, saved and loaded as one optimizer: what train.py,
    torch.amp.GradScaler (which unscales the gradients of every group in param_groups, and
    calls step() unless they overflowed), Lightning (an optimizer is what has param_groups,
    defaults, state, step(closure) and state dicts to it) and a checkpoint need of one. A
    class, as torch has no optimizer made of two."""

    def __init__(self, muon, adamw):
        self.muon, self.adamw = muon, adamw
        self.state = States(self.parts.values())
        self.defaults = {}  # each part has its own; Lightning asks that there be the attribute

    @property
    def parts(self):
        """Its two torch optimizers by name, the names its state_dict keeps them under."""
        return {"muon": self.muon, "adamw": self.adamw}

    @property
    def param_groups(self):
        return self.muon.param_groups + self.adamw.param_groups

    def step(self, closure=None):
        """closure (Lightning's: the forward and backward) runs once, for both parts: in Muon's
        step, which runs it first, as every torch optimizer does."""
        loss = self.muon.step(closure)
        self.adamw.step()
        return loss

    def zero_grad(self, set_to_none=True):
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self):
        return {name: part.state_dict() for name, part in self.parts.items()}

    def load_state_dict(self, state):
        for name, part in self.parts.items():
            part.load_state_dict(state[name])


class States(collections.abc.MutableMapping):
    """The per-parameter states of several optimizers, whose parameters are disjoint, as one
    mapping: each parameter's state is read and written in its own optimizer's (Lightning
    moves every state to the device through it)."""

    def __init__(self, optimizers):
        self.optimizers = list(optimizers)

    def owner(self, p):
        for o in self.optimizers:
            if any(p is q for g in o.param_groups for q in g["params"]):
                return o
        raise KeyError(p)  # a tensor none of them steps: not in the mapping

    def __getitem__(self, p):
        return self.owner(p).state[p]

    def __setitem__(self, p, value):
        self.owner(p).state[p] = value

    def __delitem__(self, p):
        del self.owner(p).state[p]

    def __iter__(self):
        return itertools.chain.from_iterable(o.state for o in self.optimizers)

    def __len__(self):
        return sum(len(o.state) for o in self.optimizers)


def set_lr(optimizer, cfg, it):
    """Set every group's learning rate for step it, and return the schedule's (lr_at): the
    AdamW groups take it, Muon's muon_lr / learning_rate times it."""
    lr = schedule.lr_at(cfg, it)
    adamw_groups, muon_groups = (optimizer.adamw.param_groups, optimizer.muon.param_groups) \
        if isinstance(optimizer, MuonAdamW) else (optimizer.param_groups, [])
    for group in adamw_groups:
        group["lr"] = lr
    for group in muon_groups:
        group["lr"] = cfg.muon_lr * (lr / cfg.learning_rate)
    return lr


def tail_start(cfg):
    """ema_tail: the first step that the average takes in, the last ema_tail of max_iters (a step
    at least)."""
    return cfg.max_iters - math.ceil(cfg.ema_tail * cfg.max_iters)


def weights_and_states(optimizer):
    """(parameter, its state) of each parameter the optimizer has stepped (a state to add to)."""
    parts = optimizer.parts.values() if isinstance(optimizer, MuonAdamW) else [optimizer]
    return [(p, o.state[p]) for o in parts for g in o.param_groups for p in g["params"]
            if o.state.get(p)]


@torch.no_grad()
def average(optimizer, cfg, it):
    """After step it, the weights taken into their average, from the tail's first step (where the
    average starts as the weights: also a resume on another max_iters starts it again there)."""
    start = tail_start(cfg)
    if not cfg.ema_tail or it < start:
        for _, state in weights_and_states(optimizer):
            state.pop("ema", None)  # a resume's with the tail off, or later: not kept
        return
    for p, state in weights_and_states(optimizer):
        if it == start or "ema" not in state:
            state["ema"] = p.detach().clone()
        else:
            local(state["ema"]).lerp_(local(p), 1 - cfg.ema_decay)


@torch.no_grad()
def use_average(optimizer):
    """The weights become their average, where there is one: what a run ends with."""
    for p, state in weights_and_states(optimizer):
        if "ema" in state:
            local(p).copy_(local(state["ema"]))
