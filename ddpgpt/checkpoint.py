"""Checkpoints in out_dir: ckpt_<iter>.pt, written whole under a temporary name, then renamed.

The contents (contents()) use nanoGPT's key layout (model, optimizer, model_args, iter_num,
best_val_loss, config) plus scaler, samples_consumed (the data position), data_meta (the data's
meta.json, which names the tokenizer) and data_identity (what the data is, so that a resume
on other data is caught). A nanoGPT ckpt.pt in out_dir is found too, as the oldest. Loading
never runs code from the file (weights_only=True).
"""
import dataclasses
import glob
import os
import pickle
import re
import shutil

import torch

from ddpgpt import fileio
from ddpgpt.errors import UserError

_NAME = re.compile(r"ckpt_(\d+)\.pt$")
REQUIRED_KEYS = ("model", "model_args", "iter_num")


def path_for(out_dir, iter_num):
    return os.path.join(out_dir, f"ckpt_{iter_num:07d}.pt")


def list_checkpoints(out_dir):
    """Checkpoint paths in out_dir, newest first."""
    ours = sorted((p for p in glob.glob(os.path.join(out_dir, "ckpt_*.pt"))
                   if _NAME.search(p)), key=lambda p: int(_NAME.search(p).group(1)), reverse=True)
    nanogpt = os.path.join(out_dir, "ckpt.pt")
    return ours + ([nanogpt] if os.path.isfile(nanogpt) else [])


def contents(*, model, optimizer, scaler, model_args, cfg, iter_num, samples_consumed,
             best_val_loss, data_meta, data_identity):
    """What a checkpoint holds, for save()."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(), "model_args": model_args, "iter_num": iter_num,
            "samples_consumed": samples_consumed, "best_val_loss": best_val_loss,
            "config": dataclasses.asdict(cfg), "data_meta": data_meta,
            "data_identity": data_identity}


def save(out_dir, state, keep):
    """Write state as the checkpoint of state['iter_num'] and keep the newest `keep`."""
    path = path_for(out_dir, state["iter_num"])
    tmp = fileio.tmp_path(path)
    # a killed writer's (with the out_dir's lock held, no other writer is alive)
    for stale in glob.glob(os.path.join(glob.escape(out_dir), "ckpt_*.pt.*tmp")):
        os.remove(stale)
    try:
        torch.save(state, tmp)
        fileio.publish(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save reports a short write as RuntimeError
        why = fileio.disk_full(e, out_dir) or str(e).strip()  # before the .tmp's space is freed
        if os.path.exists(tmp):
            os.remove(tmp)
        raise UserError(
            f"could not write checkpoint {path}: {why}. The previous checkpoints in "
            f"{out_dir} are intact; free space or set out_dir elsewhere, then resume with "
            f"--init_from=resume.") from e
    for old in list_checkpoints(out_dir)[keep:]:
        if _NAME.search(old):
            os.remove(old)
    return path


def model_state(state):
    """The model weights of a checkpoint, ready for GPT.load_state_dict: without the prefix
    torch.compile adds, and without the causal-mask buffers of pre-2.0 nanoGPT checkpoints."""
    return {k.removeprefix("_orig_mod."): v for k, v in state["model"].items()
            if not k.endswith(".attn.bias") or v.dim() != 4}


def refused(error):
    """What to say of a file that torch.load(weights_only=True) refused because unpickling it
    would import and call something (its pickle names a global); None for other errors. Not
    torch's own message: that advises loading with weights_only=False, which runs the code."""
    if not (isinstance(error, pickle.UnpicklingError) and "Weights only load" in str(error)):
        return None
    named = re.search(r"GLOBAL ([\w.]+)", str(error))
    return (f"was refused: loading it would execute code (its pickle calls "
            f"{named.group(1) if named else 'a function'}; a checkpoint holds only tensors and "
            f"plain values), and ddpgpt never loads such a file. Use checkpoints from a source "
            f"you trust")


def read(path):
    """(state, None) for a checkpoint file that loads, else (None, what is wrong with it)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated zip, a pickle with code in it...
        return None, refused(e) or (f"cannot be loaded ({type(e).__name__}: "
                                    f"{str(e).splitlines()[0][:200] if str(e) else ''})")
    missing = [k for k in REQUIRED_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        return None, f"is not a checkpoint (it has no {', '.join(missing)})"
    return state, None


def load_latest(out_dir, log=print):
    """(state, path) of the newest checkpoint that loads, or (None, None) if there is none.
    A damaged newest checkpoint is reported and skipped in favour of the one before it."""
    for path in list_checkpoints(out_dir):
        state, problem = read(path)
        if state is not None:
            return state, path
        log(f"checkpoint: {path} {problem}; trying an older one")
    return None, None


def check_room(out_dir, n_params):
    """out_dir can be written, and has room for a checkpoint of a model of n_params."""
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
