"""Start-up: everything a training run starts from, checked on every rank before any rank takes
a step, so that bad input ends the run at once with one clear message instead of a hang or a
traceback mid-run: the distributed set-up and the device, the checkpoint to resume or the
weights to start from, the data (one folder or a mixture), and the ranks' agreement that they
see the same data. train.py calls these in main().
"""
import math
import os
import shutil
import signal
import sys
from datetime import timedelta
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist

import checkpoint
import data
import hellaswag
import hf
import tokenfile
import weights
from errors import UserError
from model import GPT, GPTConfig
from tokenizer import byte_lengths

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
INIT_FROM = ("scratch", "resume", "auto")  # else GPT-2's weights
ARCHITECTURE = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size")


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


# ---- the model: from scratch, a checkpoint, or GPT-2's weights ----

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


# ---- the data: one folder or a mixture, and what evaluation needs of it ----

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


def open_scoring(cfg, meta, vocab_size, log):
    """(the bytes each token id stands for, for bits per byte, or None; HellaSwag prepared, or
    None). Both need the data's tokenizer (GPT-2's for nanoGPT's raw files, as sample.py
    assumes), with no more ids than the model has. Without it the evaluations have no bits per
    byte, and HellaSwag is an error."""
    try:
        tok = weights.tokenizer_of(meta, vocab_size)
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


def log_mixture(log, mix, samples, block_size):
    """Each source's share of the samples (not of the tokens on disk), and so how many epochs
    of it max_iters reads."""
    for name, weight, token_split in zip(mix.names, mix.weights, mix.splits):
        blocks = int(data.blocks_per_epoch(np.diff(token_split.starts), block_size).sum())
        log(f"data: {name} ({os.path.dirname(token_split.paths[0])}): {weight:.2%} of the "
            f"samples, {samples * weight / blocks:,.2f} epochs of its {blocks:,} blocks by "
            f"max_iters")


# ---- all of it, and every rank's agreement ----

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


# ---- every rank's agreement ----

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
