"""Train a GPT with DistributedDataParallel, on one process or many.

  python train.py config/quickstart.py                       # one process, CPU or one GPU
  torchrun --standalone --nproc_per_node=8 train.py config/owt.py --batch_size=16
  srun python train.py config/owt.py                         # one SLURM task per GPU

Every key, its default and its type is in TrainConfig below; config files and --key=value
arguments override them (configurator.py). The data position is a number of global samples
(data.py), so a run resumes exactly, also on another world size with the same global batch.

The file reads top to bottom: the configuration, the distributed set-up, start-up (everything
that can fail on bad input, checked on every rank before the first step), evaluation, one
optimizer step, and main() with the training loop.
"""
import dataclasses
import json
import math
import os
import resource
import secrets
import shutil
import signal
import statistics
import sys
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint
import configurator
import data
import fileio
import hellaswag
import hf
import tokenfile
import watchdog
import weights
from errors import UserError
from model import GPT, GPTConfig
from tokenizer import byte_lengths

Dtype = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass
class TrainConfig:
    # I/O
    out_dir: str = "out"
    eval_interval: int = 2000
    log_interval: int = 1
    eval_iters: int = 200  # evaluation reads eval_iters * batch_size fixed windows per split
    eval_only: bool = False
    always_save_checkpoint: bool = True  # else only when val loss improves (and at the end)
    # scratch, resume, auto (resume if possible), or GPT-2's weights to start from: gpt2,
    # gpt2-medium, gpt2-large, gpt2-xl or a Hugging Face GPT-2 folder (hf.py)
    init_from: str = "scratch"
    keep_checkpoints: int = 3
    # HellaSwag at the evaluations whose iter is a multiple of this (0: never), on all ranks
    hellaswag_interval: int = 0
    hellaswag_path: str = ""  # its validation file; '' for the cached copy, downloaded once
    # wandb
    wandb_log: bool = False
    wandb_project: str = "ddpgpt"
    wandb_run_name: str = "gpt2"
    # data
    data_dir: str = "data/openwebtext"
    data_mix: str = ""  # 'data/web=0.7,data/code=0.3': sources and their shares of the samples
    allow_data_change: bool = False  # resume on other data than the checkpoint's
    sampling: Literal["epoch", "random"] = "epoch"  # epoch: every block once; random: nanoGPT's
    gradient_accumulation_steps: int = 5 * 8  # global: divided by the world size
    batch_size: int = 12  # per rank and micro-step
    block_size: int = 1024
    # model
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = False
    vocab_size: int = 0  # 0: the data's vocabulary rounded up to a multiple of 64
    # AdamW and its schedule
    learning_rate: float = 6e-4
    max_iters: int = 600000
    weight_decay: float = 1e-1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping
    decay_lr: bool = True
    lr_schedule: Literal["cosine", "wsd"] = "cosine"  # wsd: warm-up, stable, then a cooldown
    warmup_iters: int = 2000
    lr_decay_iters: int = 600000  # cosine: where it reaches min_lr
    cooldown_frac: float = 0.2  # wsd: the last share of max_iters, decaying as 1 - sqrt
    min_lr: float = 6e-5
    nan_policy: Literal["stop", "skip"] = "stop"  # on a non-finite loss or gradient
    spike_policy: Literal["off", "skip"] = "off"  # skip: a step whose loss or gradient norm
    spike_zscore: float = 6.0  # is this many standard deviations above the last 100 steps
    # system
    backend: Literal["", "nccl", "gloo"] = ""  # '' picks nccl on CUDA, gloo on CPU
    device: str = "auto"  # 'auto' and 'cuda': cuda:<local rank> when CUDA is there, else cpu
    dtype: Dtype = "auto"  # 'auto': bfloat16 on CUDA that has it, else float16; float32 on CPU
    compile: bool = False
    dist_timeout_s: int = 600  # how long a collective may wait before the run fails
    # no step for max(hang_timeout_s, 10 x the median step): each rank's stacks, then exit;
    # startup_timeout_s until the first step completes. 0: off. (watchdog.py)
    hang_timeout_s: int = 300
    startup_timeout_s: int = 1800
    seed: int = 1337


INIT_FROM = ("scratch", "resume", "auto")  # else GPT-2's weights
ARCHITECTURE = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size")
# the ranges the types cannot say (the configurator checks the types and the choices)
AT_LEAST = {**dict.fromkeys(("batch_size", "block_size", "gradient_accumulation_steps",
                             "eval_iters", "eval_interval", "log_interval", "keep_checkpoints",
                             "n_layer", "n_head", "n_embd", "dist_timeout_s"), 1),
            **dict.fromkeys(("learning_rate", "min_lr", "weight_decay", "grad_clip",
                             "max_iters", "warmup_iters", "lr_decay_iters", "vocab_size", "seed",
                             "hang_timeout_s", "startup_timeout_s", "hellaswag_interval"), 0)}
BELOW_ONE = ("dropout", "beta1", "beta2")  # and at least 0
SPIKE_WINDOW, SPIKE_WARMUP = 100, 20  # steps a spike is judged against; fewer: no judging
# Dense bf16 tensor peak of one GPU, for MFU, by a part of its name; the first that matches
# counts, so a variant comes before its family. From NVIDIA's datasheets, which print the
# peak with 2:4 sparsity: half of it is the dense one.
PEAK_FLOPS = [("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12),  # H100 datasheet
              ("H200 NVL", 835e12), ("H200", 989e12),  # H200 datasheet
              ("B200", 2250e12),  # HGX B200 datasheet: 36 PFLOPS sparse for 8 GPUs
              ("A100", 312e12),  # A100 datasheet, SXM and PCIe alike
              ("L40S", 362e12),  # L40S datasheet
              ("A10G", 70e12)]  # AWS's A10G (not NVIDIA's A10, 125e12)


def peak_flops(device):
    """The device's dense bf16 peak in FLOP/s, for MFU; None when unknown (or a CPU)."""
    if torch.device(device).type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device))


def peak_flops_of(name):
    return next((flops for part, flops in PEAK_FLOPS if part in name), None)


def check_config(cfg):
    for key, low in AT_LEAST.items():
        value = getattr(cfg, key)
        if not low <= value < math.inf:  # not nan either
            raise UserError(f"{key}={value!r} must be at least {low}")
    for key in BELOW_ONE:
        if not 0 <= getattr(cfg, key) < 1:
            raise UserError(f"{key}={getattr(cfg, key)!r} must be at least 0 and below 1")
    if not 0 < cfg.cooldown_frac <= 1:
        raise UserError(f"cooldown_frac={cfg.cooldown_frac!r} must be above 0 and at most 1")
    if not 0 < cfg.spike_zscore < math.inf:
        raise UserError(f"spike_zscore={cfg.spike_zscore!r} must be above 0")
    if cfg.n_embd % cfg.n_head:
        raise UserError(f"n_embd={cfg.n_embd} must be a multiple of n_head={cfg.n_head}")
    hf.check_init_from(cfg.init_from, INIT_FROM)


# ---- the distributed set-up ----

def distributed_env():
    """(rank, local_rank, world_size): torchrun's variables, else one srun task per process."""
    env = os.environ
    if "RANK" in env:
        return int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"])
    if int(env.get("SLURM_NTASKS", 1)) > 1 and "SLURM_PROCID" in env:
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            if key not in env:
                raise UserError(
                    f"{key} is not set: with one srun task per GPU, train.py needs MASTER_ADDR "
                    f"and MASTER_PORT; launch through launch/srun.sh, which sets them.")
        rank, local_rank = int(env["SLURM_PROCID"]), int(env["SLURM_LOCALID"])
        world_size = int(env["SLURM_NTASKS"])
        # init_process_group's env:// rendezvous reads RANK and WORLD_SIZE: set them as
        # torchrun would (srun sets only the SLURM_* variables)
        env.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size))
        return rank, local_rank, world_size
    return 0, 0, 1


def pick_device(device, local_rank, ranks_here=1):
    """'auto' is this rank's GPU when torch sees one, else the CPU; 'cuda' is this rank's GPU,
    cuda:<local rank>, since a launcher starts one process per GPU. ranks_here: the ranks on
    this node, which one cuda:N would all put on one GPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        chosen = torch.device(device)
    except RuntimeError:
        raise UserError(f"device={device!r} is not a device: use auto, cpu, cuda (this rank's "
                        f"GPU) or cuda:N.") from None
    if chosen.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise UserError(f"device={device!r}, but torch {torch.__version__} sees no CUDA device "
                        f"(built for CUDA {torch.version.cuda or 'none: a CPU build'}): use "
                        f"--device=cpu, or install torch's CUDA build.")
    if chosen.index is not None and ranks_here > 1:
        raise UserError(f"device={device!r} puts all {ranks_here} ranks of this node on one GPU: "
                        f"use --device=cuda, which gives each rank its own, cuda:<local rank>.")
    index = local_rank if chosen.index is None else chosen.index
    if index >= torch.cuda.device_count():
        raise UserError(f"this rank needs GPU cuda:{index}, but torch sees "
                        f"{torch.cuda.device_count()}: start at most that many ranks per node.")
    return f"cuda:{index}"


def pick_dtype(cfg, device_type):
    if cfg.dtype != "auto":
        return cfg.dtype
    if device_type == "cuda":  # emulated bf16 (V100, T4) is slow: float16 + GradScaler there
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        return "bfloat16" if native else "float16"
    return "float32"


def init_distributed(cfg, device, world_size):
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(device)
        # float32 matmuls in TF32 where the tensor cores have it, as nanoGPT: float32 runs
        # (and autocast's float32 parts) go several times faster at a precision loss that
        # training does not notice
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if world_size > 1:
        backend = cfg.backend or ("nccl" if torch.device(device).type == "cuda" else "gloo")
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.dist_timeout_s),
                                device_id=torch.device(device) if backend == "nccl" else None)


def catch_stop_signals():
    """Record SIGUSR1 (SLURM's warning before a time limit), SIGTERM (scancel, preemption) and
    SIGINT (Ctrl-C) instead of dying: the ranks then agree on a step to stop at, and rank 0
    saves. A second Ctrl-C stops at once, unsaved. Caught from the start, so that a signal
    that comes while the model is built is not lost."""
    received = []

    def on_signal(signum, frame):
        if signum == signal.SIGINT and signal.SIGINT in received:
            print("train.py: interrupted again: stopping now, without saving", file=sys.stderr)
            os._exit(130)
        received.append(signum)

    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    return received


# ---- start-up: everything that can fail on bad input, before any rank takes a step ----

def model_args(cfg, meta):
    """GPTConfig's arguments for a model trained from scratch on data described by meta."""
    vocab_size = cfg.vocab_size
    if not vocab_size:  # a multiple of 64 runs faster on GPUs; 50304 is GPT-2's, as nanoGPT
        vocab_size = 50304 if meta is None else -(-meta["vocab_size"] // 64) * 64
    return dict(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                block_size=cfg.block_size, bias=cfg.bias, dropout=cfg.dropout,
                vocab_size=vocab_size)


def take_architecture(cfg, given, args, weights_args, source):
    """The model arguments of existing weights (all but dropout, which is the run's), as in
    nanoGPT. An architecture key the user set to another value is an error, not a silent
    override; the configuration then says what is trained, so its log and checkpoints do not
    lie."""
    conflicts = [f"{k}={getattr(cfg, k)!r} ({weights_args[k]!r} there)" for k in ARCHITECTURE
                 if k in given and k in weights_args and getattr(cfg, k) != weights_args[k]]
    if conflicts:
        raise UserError(f"{', '.join(conflicts)}: the architecture comes from {source}. Leave "
                        f"these keys out (or set them to the values there), or train from "
                        f"scratch in another out_dir.")
    args = {**args, **{k: v for k, v in weights_args.items() if k != "dropout"}}
    for key in ARCHITECTURE:
        setattr(cfg, key, args[key])
    return args


def load_resume_state(cfg, log):
    """The checkpoint to resume from, or None to start fresh. GPT-2's weights are a fresh
    start as auto sees it: in an out_dir with a checkpoint the run resumes, so that a restarted
    or requeued fine-tune goes on from its last checkpoint instead of from iter 0 again."""
    if cfg.init_from == "scratch":
        return None
    state, path = checkpoint.load_latest(cfg.out_dir, log=log)
    if state is None and cfg.init_from == "resume":
        raise UserError(f"init_from='resume' but {cfg.out_dir} holds no loadable checkpoint "
                        f"(ckpt_*.pt): train from scratch with --init_from=scratch, or use "
                        f"--init_from=auto.")
    if state is not None:
        log(f"resuming from {path} (iter {state['iter_num']})")
    return state


def check_pretrained_data(cfg, meta, weights_args, source):
    """The data must be in the weights' tokens: OpenAI's read GPT-2's; a folder's must at least
    have an embedding for every token id."""
    tokens = (meta or {}).get("tokenizer")
    if cfg.init_from in hf.NAMES and tokens not in (None, *hf.GPT2_TOKENIZERS) or \
            meta is not None and meta["vocab_size"] > weights_args["vocab_size"]:
        raise UserError(
            f"{cfg.data_dir} holds {tokens!r} tokens ({meta['vocab_size']} ids), which "
            f"{source} ({weights_args['vocab_size']} token ids) cannot read: prepare the data "
            f"with the tokenizer those weights were trained with (--tokenizer=gpt2 for "
            f"OpenAI's GPT-2).")


def take_pretrained(cfg, given, args, meta, log):
    """(weights, model_args) of GPT-2's weights (hf.py). As in nanoGPT the architecture is
    theirs, but a smaller block_size crops the position table (the first positions are the
    same)."""
    weights, weights_args = hf.load(cfg.init_from, log=log)
    source, positions = f"the weights of {cfg.init_from}", weights_args["block_size"]
    check_pretrained_data(cfg, meta, weights_args, source)
    if "block_size" in given and cfg.block_size > positions:
        raise UserError(f"block_size={cfg.block_size} is more than the {positions} positions "
                        f"of {source}: use block_size <= {positions} (a smaller one crops them).")
    if "block_size" in given:
        weights_args["block_size"] = cfg.block_size
        weights["transformer.wpe.weight"] = weights["transformer.wpe.weight"][:cfg.block_size]
    return weights, take_architecture(cfg, given, args, weights_args, source)


def samples_consumed(resume, global_batch):
    """A checkpoint's data position; nanoGPT's checkpoints have none, but took whole steps."""
    return resume.get("samples_consumed", resume["iter_num"] * global_batch)


def check_resume(cfg, resume, meta, world_size, log):
    if cfg.gradient_accumulation_steps % world_size:
        micro = cfg.gradient_accumulation_steps
        raise UserError(
            f"gradient_accumulation_steps={micro} is the global number of micro-steps and must "
            f"be a multiple of the world size {world_size}: use "
            f"{max(1, micro // world_size) * world_size}.")
    if resume is None:
        return
    used = (resume.get("data_meta") or {}).get("tokenizer")
    if meta is not None and used is not None and used != meta.get("tokenizer"):
        raise UserError(
            f"the checkpoint was trained on {used!r} tokens but {cfg.data_dir} holds "
            f"{meta.get('tokenizer')!r} tokens: set data_dir to data made with {used!r}.")
    global_batch = cfg.batch_size * cfg.gradient_accumulation_steps
    old_mix = (resume.get("config") or {}).get("data_mix", "")
    if old_mix != cfg.data_mix and (old_mix or len(data_sources(cfg, set())) > 1):
        log(f"note: data_mix was {old_mix!r} and is now {cfg.data_mix!r}: the run goes on "
            f"from the same global sample, but which source each sample comes from differs "
            f"from here on from what the old mixture would have read.")
    if samples_consumed(resume, global_batch) % global_batch:
        raise UserError(
            f"the checkpoint consumed {samples_consumed(resume, global_batch)} samples, not a "
            f"whole number of global batches of {global_batch} (batch_size x "
            f"gradient_accumulation_steps): resume with a global batch that divides it.")


def check_same_data_as_resumed(cfg, resume, identity, log):
    """Resuming "at the exact data position" of other data would be a silent lie: refuse it,
    unless the user says the change is meant."""
    before = (resume or {}).get("data_identity")
    if before is None or before == identity:
        return
    what = f"data_mix={cfg.data_mix!r}" if cfg.data_mix else f"data_dir={cfg.data_dir!r}"
    if not cfg.allow_data_change:
        raise UserError(
            f"{what} is not the data the checkpoint in {cfg.out_dir} was trained on (tokens "
            f"and fingerprint per split: {before} then, {identity} now): point it at that data "
            f"again, or pass --allow_data_change=True to go on from the same sample index "
            f"in this data.")
    log(f"warning: {what} is not the data the checkpoint was trained on; going on from the "
        f"same sample index in it, as allow_data_change=True asks")


def check_out_dir(out_dir, n_params):
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, f".write_test_{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        raise UserError(f"out_dir {out_dir} cannot be written ({e.strerror or e}): set "
                        f"--out_dir to a folder you can write to.") from e
    need = n_params * 4 * 3 * 1.1  # fp32 weights and two AdamW moments
    free = shutil.disk_usage(out_dir).free
    if free < need:
        raise UserError(f"out_dir {out_dir} has {free / 2**20:.0f} MiB free, less than one "
                        f"checkpoint needs (about {need / 2**20:.0f} MiB): free space or move "
                        f"out_dir.")


def data_sources(cfg, given):
    """(folder, weight, name in metrics) of each data source: data_mix's, else data_dir."""
    if not cfg.data_mix:
        return [(cfg.data_dir, 1.0, "")]
    if "data_dir" in given:
        raise UserError(f"data_dir={cfg.data_dir!r} and data_mix={cfg.data_mix!r} are both set: "
                        f"keep data_mix (each source and its weight) to train on the mixture, "
                        f"or drop it to train on data_dir alone.")
    sources, names = [], []
    for part in cfg.data_mix.split(","):
        folder, has_weight, weight = part.strip().rpartition("=")
        if not has_weight:  # a source without a weight weighs 1
            folder, weight = weight, "1"
        try:
            weight = float(weight)
        except ValueError:
            weight = None
        if weight is None or not 0 < weight < math.inf:
            raise UserError(f"data_mix source {part.strip()!r}: the weight must be a number "
                            f"above 0, as in data_mix='data/web=0.7,data/code=0.3'.")
        if not os.path.isdir(folder):
            raise UserError(f"data_mix source {folder!r} is not a folder: give each source as "
                            f"<data folder>=<weight>, separated by commas.")
        name = os.path.basename(os.path.normpath(folder))
        names.append(name if name not in names else f"{name}-{names.count(name) + 1}")
        sources.append((folder, weight, names[-1]))
    return sources if len(sources) > 1 else [(sources[0][0], 1.0, "")]


def check_same_tokenizer(sources, metas):
    kinds = {(m or {}).get("tokenizer"): folder for (folder, _, _), m in zip(sources, metas)}
    sizes = {(m or {}).get("vocab_size") for m in metas}
    if len(kinds) > 1 or len(sizes) > 1:
        detail = ", ".join(f"{folder}: {m and m.get('tokenizer')!r}, {m and m.get('vocab_size')} "
                           f"ids" for (folder, _, _), m in zip(sources, metas))
        raise UserError(f"the data_mix sources were not made with one tokenizer ({detail}): "
                        f"prepare them all with the same --tokenizer.")


def open_data(cfg, sources, vocab_size, log):
    """{split: the Mixture of the sources' token files}; the split's mixture has one source in
    the plain case."""
    return {split: data.mixture([tokenfile.open_split(folder, split, cfg.block_size, vocab_size,
                                                      log=log) for folder, _, _ in sources],
                                [w for _, w, _ in sources], [n for _, _, n in sources])
            for split in tokenfile.SPLITS}


def start_up(cfg, given, world_size, log):
    """(checkpoint to resume or None, the data's meta.json, model_args, {split: Mixture},
    the model on the CPU). Raises UserError for anything the user must fix."""
    resume = load_resume_state(cfg, log)
    sources = data_sources(cfg, given)
    metas = [tokenfile.read_meta(folder) for folder, _, _ in sources]
    check_same_tokenizer(sources, metas)
    meta = metas[0]
    args = model_args(cfg, meta)
    cfg.vocab_size = args["vocab_size"]  # what 0 meant, so that the configuration says it
    if resume is not None:
        args = take_architecture(cfg, given, args, resume["model_args"],
                                 f"the checkpoint in {cfg.out_dir}")
    pretrained = None
    if cfg.init_from not in INIT_FROM and resume is None:
        pretrained, args = take_pretrained(cfg, given, args, meta, log)
    splits = open_data(cfg, sources, args["vocab_size"], log)
    check_resume(cfg, resume, meta, world_size, log)
    check_same_data_as_resumed(cfg, resume, data_identity(splits), log)
    if cfg.eval_only and resume is None and cfg.init_from == "resume":
        raise UserError(f"eval_only with init_from='resume' needs a checkpoint in {cfg.out_dir}")
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(**args))
    if resume is not None:
        model.load_state_dict(checkpoint.model_state(resume))
    if pretrained is not None:
        model.load_state_dict(pretrained)
    check_out_dir(cfg.out_dir, sum(p.numel() for p in model.parameters()))
    return resume, meta, args, splits, model


def open_scoring(cfg, meta, vocab_size, log):
    """(the bytes each token id stands for, for bits per byte, or None; HellaSwag prepared, or
    None). Both need the data's tokenizer (GPT-2's for nanoGPT's raw files, as sample.py
    assumes), with no more ids than the model has. Without it the evaluations have no bits per
    byte, and HellaSwag is an error."""
    try:
        tok = weights.tokenizer_of((meta or {}).get("tokenizer") or "gpt2", vocab_size)
    except UserError as e:
        if cfg.hellaswag_interval:
            raise UserError(f"hellaswag_interval={cfg.hellaswag_interval} needs the data's "
                            f"tokenizer: {e}") from e
        log(f"note: the evaluations leave bits per byte out: {e}")
        return None, None
    if not cfg.hellaswag_interval:
        return byte_lengths(tok, vocab_size), None
    return byte_lengths(tok, vocab_size), hellaswag.prepare(
        cfg.hellaswag_path, tok, cfg.block_size, cfg.batch_size * cfg.block_size, log)


def restore(cfg, model, resume, device_type, global_batch):
    """(optimizer, scaler, iter_num, samples, best_val) of a fresh run, or as a checkpoint
    left them. iter_num counts optimizer steps (the learning rate follows it); samples counts
    the global samples read (the data position). They part when a run resumes with another
    global batch, which is why the batch index is always samples // global_batch."""
    scaler = torch.amp.GradScaler(device_type, enabled=pick_dtype(cfg, device_type) == "float16")
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate,
                                           (cfg.beta1, cfg.beta2), device_type)
    if resume is None:
        return optimizer, scaler, 0, 0, float("inf")
    optimizer.load_state_dict(resume["optimizer"])
    if "scaler" in resume:
        scaler.load_state_dict(resume["scaler"])
    return (optimizer, scaler, resume["iter_num"], samples_consumed(resume, global_batch),
            resume.get("best_val_loss", float("inf")))


def autocast_for(dtype, device_type):
    if dtype == "float32":
        return nullcontext()
    return torch.autocast(device_type, dtype={"bfloat16": torch.bfloat16,
                                              "float16": torch.float16}[dtype])


def log_mixture(log, mix, samples, block_size):
    """Each source's share of the samples (not of the tokens on disk), and so how many epochs
    of it max_iters reads."""
    for name, weight, token_split in zip(mix.names, mix.weights, mix.splits):
        blocks = int(data.blocks_per_epoch(np.diff(token_split.starts), block_size).sum())
        log(f"data: {name} ({os.path.dirname(token_split.paths[0])}): {weight:.2%} of the "
            f"samples, {samples * weight / blocks:,.2f} epochs of its {blocks:,} blocks by "
            f"max_iters")


def agree(error, rank, world_size):
    """Share each rank's start-up error so that all ranks stop together and rank 0 reports
    every distinct problem once; no rank is left waiting in a later collective."""
    errors = [error]
    if world_size > 1:
        errors = [None] * world_size
        dist.all_gather_object(errors, error)
    problems = {}
    for r, e in enumerate(errors):
        if e is not None:
            problems.setdefault(e, []).append(r)
    if problems and rank == 0:
        for message, ranks in problems.items():
            where = "" if world_size == 1 else \
                f" (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
            print(f"train.py: error{where}: {message}", file=sys.stderr)
    return not problems


def data_identity(splits):
    """{split: [tokens, fingerprint] of each source, sorted}: what the data is, whatever its
    folder is called or its sources are weighed."""
    return {split: sorted([t.n_tokens, tokenfile.sampled_fingerprint(t.paths, t.header_bytes)]
                          for t in mix.splits) for split, mix in splits.items()}


def same_data_on_all_ranks(splits, data_dir, rank, world_size):
    """Every node must read the same token files, or the global batches are not one batch."""
    if world_size == 1:
        return True
    mine = data_identity(splits)
    identities = [None] * world_size
    dist.all_gather_object(identities, mine)
    if all(i == identities[0] for i in identities):
        return True
    if rank == 0:
        detail = "; ".join(f"rank {r}: {i}" for r, i in enumerate(identities))
        print(f"train.py: error: the ranks do not see the same data in {data_dir} (tokens, "
              f"fingerprint per split: {detail}): every node must hold the same files.",
              file=sys.stderr)
    return False


# ---- evaluation and the learning rate ----

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


@torch.no_grad()
def evaluate(model, splits, cfg, rank, world_size, autocast, device, vocab_size,
             token_bytes=None):
    """{'train_loss': ..., 'val_loss': ...}: the mean loss over the fixed evaluation windows of
    each split, shared out over the ranks, and with token_bytes the bits per byte ('val_bpb');
    for a mixture, each source's too ('val_loss/web', 'val_bpb/web'), and the split's value is
    their average by weight. cfg: anything with block_size, batch_size and eval_iters."""
    model.eval()
    out = {}
    for split, mix in splits.items():
        results = [split_loss(model, t, cfg, rank, world_size, autocast, device, vocab_size,
                              token_bytes) for t in mix.splits]
        for k, what in enumerate(("loss",) if token_bytes is None else ("loss", "bpb")):
            values = [r[k] for r in results]
            out[f"{split}_{what}"] = sum(w * v for w, v in zip(mix.weights, values))
            if len(values) > 1:
                out.update({f"{split}_{what}/{n}": v for n, v in zip(mix.names, values)})
    model.train()
    return out


def split_loss(model, token_split, cfg, rank, world_size, autocast, device, vocab_size,
               token_bytes=None):
    """(mean loss, bits per byte or None without token_bytes). Bits per byte are the summed
    cross-entropy of every target token scored, in bits, over the bytes of text those same
    tokens stand for (token_bytes[id], tokenizer.byte_lengths): comparable across tokenizers.
    The losses stay on the device until the one transfer at the end."""
    offsets = data.eval_offsets(token_split.starts, cfg.block_size,
                                cfg.eval_iters * cfg.batch_size)[rank::world_size]
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    n_bytes = 0
    for i in range(0, len(offsets), cfg.batch_size):
        chunk = offsets[i:i + cfg.batch_size]
        x, y = data.read_xy(token_split, chunk, cfg.block_size, vocab_size)
        with autocast:
            _, loss = model(x.to(device), y.to(device))
        loss_sum += loss.double() * len(chunk)
        if token_bytes is not None:
            n_bytes += int(token_bytes[y.numpy()].sum())
    total = torch.stack([loss_sum, torch.full_like(loss_sum, len(offsets)),
                         torch.full_like(loss_sum, n_bytes)])
    if world_size > 1:
        dist.all_reduce(total)
    loss_sum, n, n_bytes = total.tolist()
    # every window's loss is the mean over its block_size targets: times block_size, the sum
    bpb = None if token_bytes is None else loss_sum * cfg.block_size / math.log(2) / n_bytes
    return loss_sum / n, bpb


# ---- one optimizer step ----

def settle_gradient_buckets(model, cfg, device, autocast):
    """One backward whose gradients are thrown away. DDP's first backward all-reduces every
    gradient as one bucket, and later ones in buckets rebuilt in the order the gradients came;
    with more than two ranks a sum's rounding depends on that layout. So every counted step,
    in a fresh run or after a resume, uses the rebuilt buckets, and a resumed run repeats the
    uninterrupted one bit for bit. (Two tensors, not x twice: torch.compile would guard on
    their being one and compile the graph again at the first real step.)"""
    x = torch.zeros((cfg.batch_size, cfg.block_size), dtype=torch.long, device=device)
    model.require_backward_grad_sync = True
    with autocast:
        _, loss = model(x, torch.zeros_like(x))
    loss.backward()


def forward_backward(model, batches, micro_steps, autocast, scaler, world_size):
    """This rank's micro-steps of one optimizer step: (the summed loss on the device, seconds
    spent waiting for data, seconds until the last backward, which waits for the other ranks
    in DDP: what this rank alone took). The gradients accumulate in the parameters."""
    loss_sum, data_wait, t_start = 0.0, 0.0, time.perf_counter()
    for micro_step in range(micro_steps):
        if world_size > 1:
            # DDP all-reduces the gradients in the last micro-step's backward only. nanoGPT's
            # note holds: model.no_sync() is the official way, but it bloats the code
            model.require_backward_grad_sync = micro_step == micro_steps - 1
        t = time.perf_counter()
        x, y = next(batches)
        data_wait += time.perf_counter() - t
        with autocast:
            _, loss = model(x, y)
            loss = loss / micro_steps
        alone = time.perf_counter() - t_start
        scaler.scale(loss).backward()
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
        mean, spread = statistics.fmean(seen), statistics.pstdev(seen)
        if value > mean + cfg.spike_zscore * spread:
            return (f"{name} spike: {value:.4g}, {(value - mean) / spread:.1f} standard "
                    f"deviations above the last {len(seen)} steps' {mean:.4g}")
    return None


def skip_or_stop(cfg, log, problem, iter_num, loss, batch_fp):
    """A step that was not applied: stop (nan_policy's default), or go on with the next one,
    whose data is what it would have been."""
    if problem != "non-finite":
        log(f"warning: {problem} at iter {iter_num} (batch_fp {batch_fp}): step skipped "
            f"(spike_policy='skip')")
        return
    what = f"non-finite loss {loss} or gradient norm at iter {iter_num} (batch_fp {batch_fp})"
    if cfg.nan_policy == "stop":
        raise UserError(f"{what}: training stopped without saving, so the last checkpoint is "
                        f"still good. Try a lower learning_rate, grad_clip=1.0 or "
                        f"dtype=bfloat16, and check the data at that batch; nan_policy='skip' "
                        f"skips such steps.")
    log(f"warning: {what}: step skipped (nan_policy='skip')")


def rank_telemetry(alone_s, data_wait_s, device, world_size):
    """Each rank's seconds alone in the step (before the gradients' all-reduce), seconds
    waiting for data, and peak memory (CUDA's allocated, else the process's RSS), gathered on
    every rank: one small collective, on log steps only."""
    if torch.device(device).type == "cuda":
        memory = torch.cuda.max_memory_allocated(device)
    else:
        memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    mine = torch.tensor([alone_s * 1000, data_wait_s * 1000, memory / 2**20],
                        dtype=torch.float64, device=device)
    every = [torch.zeros_like(mine) for _ in range(world_size)]
    if world_size > 1:
        dist.all_gather(every, mine)
    else:
        every = [mine]
    ms, wait, mib = zip(*torch.stack(every).tolist())
    return {"rank_ms": list(ms), "rank_data_wait_ms": list(wait), "rank_mem_mib": list(mib)}


def log_straggler(log, row):
    """Name the slowest rank when it is more than 10% slower than the median."""
    ms = row["rank_ms"]
    median = statistics.median(ms)
    slowest = max(range(len(ms)), key=ms.__getitem__)
    if len(ms) > 1 and ms[slowest] > 1.1 * median:
        log(f"iter {row['iter']}: rank {slowest} is the slowest: {ms[slowest]:.1f} ms alone in "
            f"the step against a median of {median:.1f} ms, {row['rank_data_wait_ms'][slowest]:.1f}"
            f" ms of it waiting for data")


# ---- checkpoints and metrics ----

def save_checkpoint(cfg, model, optimizer, scaler, args, meta, iter_num, samples, best_val,
                    identity):
    watchdog.beat(iter_num)  # the save gets a whole limit of its own
    return checkpoint.save(cfg.out_dir, {
        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(), "model_args": args, "iter_num": iter_num,
        "samples_consumed": samples, "best_val_loss": best_val,
        "config": dataclasses.asdict(cfg), "data_meta": meta, "data_identity": identity},
        cfg.keep_checkpoints)


def record(metrics, wandb, row):
    """One row of metrics.jsonl (and of wandb); rank 0 alone has them open."""
    if metrics is not None:
        metrics.write(json.dumps(row) + "\n")
        metrics.flush()
    if wandb is not None:
        wandb.log(row, step=row["iter"])


def log_evaluation(log, iter_num, losses):
    sources = ", ".join(f"{k.removeprefix('val_loss/')} {v:.4f}" for k, v in losses.items()
                        if k.startswith("val_loss/"))
    bpb = f", {losses['val_bpb']:.4f} bits per byte" if "val_bpb" in losses else ""
    swag = "" if "hellaswag_n" not in losses else (
        f", HellaSwag acc_norm {losses['hellaswag_acc_norm']:.4f} (acc "
        f"{losses['hellaswag_acc']:.4f}, {losses['hellaswag_n']} examples)")
    log(f"iter {iter_num}: train loss {losses['train_loss']:.4f}, val loss "
        f"{losses['val_loss']:.4f}{f' ({sources})' if sources else ''}{bpb}{swag}")


def log_step(log, row, peak):
    mfu = f", mfu {row['mfu'] * 100:.1f}%" if peak else ""
    log(f"iter {row['iter']}: loss {row['loss']:.4f}, grad norm {row['grad_norm']:.3g}, lr "
        f"{row['lr']:.2e}, {row['ms']:.1f} ms, {row['tok_per_s']:,.0f} tok/s{mfu}, data wait "
        f"{row['data_wait'] * 100:.1f}%")


def open_metrics(cfg, master):
    """(metrics.jsonl opened for appending, the wandb module once initialised) on rank 0."""
    if not master:
        return None, None
    metrics = open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a")
    if not cfg.wandb_log:
        return metrics, None
    import wandb  # slow to import, and only needed here
    wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name,
               config=dataclasses.asdict(cfg), id=wandb_run_id(cfg.out_dir), resume="allow")
    return metrics, wandb


def wandb_run_id(out_dir):
    """The wandb run of out_dir, made on its first run and kept there: a resumed or requeued
    run goes on with the same curve instead of starting a new run."""
    path = os.path.join(out_dir, "wandb_run_id")
    if not os.path.exists(path):
        with open(path + ".tmp", "w") as f:
            f.write(secrets.token_hex(4) + "\n")
        fileio.publish(path + ".tmp", path)
    with open(path) as f:
        return f.read().strip()


def main(argv):
    stop_signals = catch_stop_signals()
    cfg, given = configurator.parse_given(TrainConfig, argv)
    check_config(cfg)
    rank, local_rank, world_size = distributed_env()
    watchdog.start(cfg.out_dir, rank, world_size, cfg.hang_timeout_s, cfg.startup_timeout_s)
    log = print if rank == 0 else (lambda *a, **k: None)
    device = pick_device(cfg.device, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    init_distributed(cfg, device, world_size)
    try:
        resume, meta, args, splits, model = start_up(cfg, given, world_size, log)
        scoring = open_scoring(cfg, meta, args["vocab_size"], log)
        error = None
    except UserError as e:
        error = str(e)
    if not agree(error, rank, world_size) or \
            not same_data_on_all_ranks(splits, cfg.data_dir, rank, world_size):
        return 1
    log(f"configuration:\n{configurator.describe(cfg)}")
    train(cfg, rank, world_size, device, log, stop_signals, resume, meta, args, splits, model,
          scoring)
    if world_size > 1:
        dist.destroy_process_group()
    return 0


def train(cfg, rank, world_size, device, log, stop_signals, resume, meta, args, splits, model,
          scoring):
    master, device_type = rank == 0, torch.device(device).type
    dtype = pick_dtype(cfg, device_type)
    autocast = autocast_for(dtype, device_type)
    global_batch = cfg.batch_size * cfg.gradient_accumulation_steps
    micro_steps = cfg.gradient_accumulation_steps // world_size
    model.to(device)
    optimizer, scaler, iter_num, samples, best_val = restore(cfg, model, resume, device_type,
                                                             global_batch)
    start_iter, resume = iter_num, None  # free the checkpoint's tensors
    history = deque(maxlen=SPIKE_WINDOW)  # (loss, gradient norm) of the last applied steps
    # One set of weights, three handles: `model` owns them (checkpoints, clipping, the
    # optimizer); `forward` is what evaluation calls, beneath DDP, which averages gradients
    # that evaluation does not make, so ranks may run different numbers of evaluation batches;
    # `trained` is what the steps call, and in DDP it all-reduces the gradients in backward.
    forward = torch.compile(model) if cfg.compile else model
    trained = forward
    if world_size > 1:
        trained = DDP(forward, device_ids=[torch.device(device).index]
                      if device_type == "cuda" else None)
        settle_gradient_buckets(trained, cfg, device, autocast)
        optimizer.zero_grad(set_to_none=True)
    log(f"world size {world_size}, device {device}, dtype {dtype}, "
        f"{model.get_num_params() / 1e6:.2f}M parameters, global batch {global_batch} x "
        f"{cfg.block_size} tokens ({micro_steps} micro-steps of {cfg.batch_size} per rank)")
    if len(splits["train"].splits) > 1:
        log_mixture(log, splits["train"], cfg.max_iters * global_batch, cfg.block_size)
    metrics, wandb = open_metrics(cfg, master)
    identity = data_identity(splits)
    batches = data.rank_batches(
        splits["train"], block_size=cfg.block_size, batch_size=cfg.batch_size,
        micro_steps=micro_steps, rank=rank, world_size=world_size, seed=cfg.seed,
        mode=cfg.sampling, start_step=samples // global_batch, device=device,
        vocab_size=args["vocab_size"])
    peak = peak_flops(device)
    flops_per_step = model.flops_per_token() * global_batch * cfg.block_size

    # ---------------------------------------------------------------- TRAINING LOOP BEGIN
    t_last = time.perf_counter()
    while True:
        # evaluate, and save if this is a checkpoint to keep (not the one just resumed from)
        if iter_num % cfg.eval_interval == 0 or iter_num >= cfg.max_iters or cfg.eval_only:
            token_bytes, swag = scoring
            losses = evaluate(forward, splits, cfg, rank, world_size, autocast, device,
                              args["vocab_size"], token_bytes)
            if swag is not None and iter_num % cfg.hellaswag_interval == 0:
                # the uncompiled model: a compiled one would compile again for each new shape
                losses.update(hellaswag.evaluate(model, swag, rank, world_size, autocast, device))
            log_evaluation(log, iter_num, losses)
            record(metrics, wandb, {"iter": iter_num, **losses})
            improved = losses["val_loss"] < best_val
            best_val = min(best_val, losses["val_loss"])
            if not all(map(math.isfinite, losses.values())):
                log(f"warning: non-finite evaluation loss at iter {iter_num}: no checkpoint "
                    f"written, the previous ones are kept")
            elif master and iter_num > start_iter and (
                    improved or cfg.always_save_checkpoint or iter_num >= cfg.max_iters):
                t_save = time.perf_counter()
                path = save_checkpoint(cfg, model, optimizer, scaler, args, meta, iter_num,
                                       samples, best_val, identity)
                log(f"saved {path} ({time.perf_counter() - t_save:.2f} s)")
            t_last = time.perf_counter()
            watchdog.beat(iter_num)
        if cfg.eval_only or iter_num >= cfg.max_iters:
            break

        # one optimizer step over the global batch
        lr = lr_at(cfg, iter_num)
        for group in optimizer.param_groups:
            group["lr"] = lr
        torch.manual_seed(cfg.seed + 7919 * rank + 104729 * iter_num)  # dropout resumes exactly
        loss_sum, data_wait, alone = forward_backward(trained, batches, micro_steps, autocast,
                                                      scaler, world_size)
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
        loss, grad_norm, stop = share_step_results(loss_sum, grad_norm, stop_signals, world_size)
        problem = step_problem(cfg, loss, grad_norm, history, scaler.is_enabled())
        if problem is None:
            scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

        # everything below is diagnostics, done while the device runs the optimizer step
        batch_fp = data.global_batch_fingerprint(samples // global_batch, global_batch,
                                                 splits["train"], cfg.block_size,
                                                 cfg.seed, cfg.sampling)
        if problem is None and math.isfinite(loss):
            history.append((loss, grad_norm))
        elif problem is not None:
            skip_or_stop(cfg, log, problem, iter_num, loss, batch_fp)
        t_now = time.perf_counter()
        dt, t_last = t_now - t_last, t_now
        row = {"iter": iter_num, "loss": loss, "grad_norm": grad_norm, "lr": lr,
               "batch_fp": batch_fp, "ms": dt * 1000,
               "tok_per_s": global_batch * cfg.block_size / dt, "data_wait": data_wait / dt,
               **({"skipped": problem} if problem else {}),
               **({"mfu": flops_per_step / dt / (peak * world_size)} if peak else {})}
        if device_type == "cuda":  # the allocator's own count, read with no synchronisation
            row["peak_mem"] = torch.cuda.max_memory_allocated(device)
        if iter_num % cfg.log_interval == 0:
            row.update(rank_telemetry(alone, data_wait, device, world_size))
            log_step(log, row, peak)
            log_straggler(log, row)
        record(metrics, wandb, row)
        iter_num += 1
        samples += global_batch
        watchdog.beat(iter_num, step_s=dt)
        if stop:
            log(f"stopping at iter {iter_num}: signal received, saving a checkpoint")
            if master:
                t_save = time.perf_counter()
                path = save_checkpoint(cfg, model, optimizer, scaler, args, meta, iter_num,
                                       samples, best_val, identity)
                log(f"saved {path} ({time.perf_counter() - t_save:.2f} s)")
                log(f"interrupted at iter {iter_num}; resume with --init_from=resume")
            break
    # ---------------------------------------------------------------- TRAINING LOOP END
    watchdog.stop()

    if metrics is not None:
        metrics.close()
    if wandb is not None:
        wandb.finish()


def run_cli(argv):
    """main(), with a UserError printed as one paragraph and exit status 1. The message is
    printed before any teardown of the process group: since PyTorch 2.6 destroying it waits
    for collectives that the other ranks may never join, so this rank exits without it and
    torchrun (or srun --kill-on-bad-exit) ends the others."""
    try:
        return main(argv)
    except UserError as e:
        where = f" (rank {os.environ['RANK']})" if "RANK" in os.environ else ""
        print(f"train.py: error{where}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(run_cli(sys.argv[1:]))
