"""The model a script computes with, from what the user names, and the tokenizer it reads:

  a run's out_dir        its newest checkpoint that loads (nanoGPT's ckpt.pt too)
  one checkpoint file    ours or nanoGPT's
  GPT-2's weights        a name (gpt2, gpt2-medium, ...) or a Hugging Face folder (hf.py)

sample.py and eval.py load through load(); export.py, which exports checkpoints only, through
checkpoint_at(), data_meta() and tokenizer_of().
"""
import os
from typing import NamedTuple

import checkpoint
import hf
import tokenfile
from errors import UserError
from tokenizer import Tokenizer, for_data, get_tokenizer


class Loaded(NamedTuple):
    args: dict  # GPTConfig's arguments
    weights: dict  # for GPT.load_state_dict
    tokenizer: Tokenizer
    source: str  # what was loaded and where its tokenizer came from, for the log


def data_meta(state):
    """(the meta of a checkpoint's data, or None; where it came from). train.py keeps the data's
    meta.json (or what nanoGPT's meta.pkl holds) in the checkpoint; older checkpoints have
    none: read their data folder's (data_dir, or as nanoGPT's sample.py data/<dataset>)."""
    meta, where = state.get("data_meta"), "the checkpoint's data_meta"
    config = state.get("config") or {}
    data_dir = config.get("data_dir") or (config.get("dataset") and
                                          os.path.join("data", config["dataset"]))
    if meta is None and data_dir:
        meta, where = tokenfile.read_meta(data_dir), tokenfile.meta_path(data_dir)
    if meta and meta.get("tokenizer"):
        return meta, where
    return None, "nanoGPT's default, as the checkpoint names none"


def tokenizer_of(meta, vocab_size):
    """The tokenizer of data described by meta (GPT-2's where there is none, as nanoGPT's raw
    files are), which must not have more ids than the model can embed."""
    tok = for_data(meta) if meta else get_tokenizer("gpt2")
    if tok.vocab_size > vocab_size:
        raise UserError(f"the model has {vocab_size} token ids, fewer than {tok.name!r}'s "
                        f"{tok.vocab_size}: put its data's meta.json in the data_dir it names.")
    return tok


def checkpoint_at(source, hint, log=print):
    """(state, path) of a checkpoint file, or of the newest loadable one in an out_dir; hint
    says what to give instead."""
    if os.path.isfile(source):
        state, problem = checkpoint.read(source)
        if state is None:
            raise UserError(f"{source} {problem}: {hint}")
        return state, source
    state, path = checkpoint.load_latest(source, log=log)
    if state is None:
        what = ("holds no loadable checkpoint (ckpt_*.pt or nanoGPT's ckpt.pt)"
                if os.path.isdir(source) else "does not exist")
        raise UserError(f"{source} {what}: {hint}")
    return state, path


def load(init_from, out_dir, hint, log=print):
    """Loaded for init_from='resume' (out_dir: a run's folder or one checkpoint file), else
    for GPT-2's weights by name or folder, which read GPT-2's tokens."""
    if init_from == "resume":
        state, path = checkpoint_at(out_dir, hint, log)
        meta, where = data_meta(state)
        tok = tokenizer_of(meta, state["model_args"]["vocab_size"])
        return Loaded(state["model_args"], checkpoint.model_state(state), tok,
                      f"{path} (iter {state['iter_num']}), tokenizer {tok.name!r} from {where}")
    weights, args = hf.load(init_from, log=log)
    gpt2 = get_tokenizer("gpt2")
    if args["vocab_size"] < gpt2.vocab_size:
        raise UserError(
            f"{init_from} has {args['vocab_size']} token ids, fewer than the {gpt2.vocab_size} "
            f"of GPT-2's tokenizer, with which Hugging Face weights are read: use the "
            f"checkpoint they were exported from, with --out_dir.")
    return Loaded(args, weights, gpt2, f"{init_from}, tokenizer 'gpt2' (Hugging Face weights)")
