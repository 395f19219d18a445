"""Every `init_from`: the weights a script starts or computes with, the model's arguments, and
the tokenizer it reads.

  scratch                a new model of the settings' architecture (model_args)
  resume, auto           out_dir's newest checkpoint that loads (nanoGPT's ckpt.pt too); auto
                         starts from scratch where there is none
  a run's out_dir, or    for sample.py, eval.py and export.py (load, checkpoint_at)
  a checkpoint (file/dir)
  GPT-2's weights        a name (gpt2, gpt2-medium, ...) or a Hugging Face folder (hf.py)"""
import logging
import os
import shlex
from typing import NamedTuple, Optional

from ddpgpt import checkpoint, hf, schedule, sources
from ddpgpt.arch import ARCHITECTURE, architecture, model_args
from ddpgpt.errors import UserError
from ddpgpt.hf import NAMES
from ddpgpt.state import Saved
from ddpgpt.tokenfile import GPT2_VOCAB_SIZE
from ddpgpt.tokenizer import (GPT2_NAMES, Tokenizer, check_ids_fit, data_meta, get_tokenizer,
                              tokenizer_of)

log = logging.getLogger(__name__)

# ---- training: scratch, a checkpoint, or GPT-2's weights ----

class Start(NamedTuple):
    """What a training run starts from."""
    resume: Optional[dict]  # the checkpoint it resumes (checkpoint.resume), or None
    args: dict  # GPTConfig's arguments
    weights: Optional[dict]  # GPT-2's, for GPT.load_state_dict; None: the initialisation's


def for_training(cfg, given, meta, in_parts=False):
    """The Start of a run with these settings (given: the keys the user set) on data described
    by meta. GPT-2's weights are a fresh start as auto sees it: in an out_dir with a checkpoint
    the run resumes, so that a restarted or requeued fine-tune goes on from its last checkpoint
    instead of from iter 0 again. in_parts: a sharded run, which reads the tensors of a
    checkpoint folder in parts, once sharded (checkpoint.resume)."""
    args = model_args(cfg, meta)
    resume = None if cfg.init_from == "scratch" else \
        newest_checkpoint(cfg, () if in_parts else checkpoint.TENSORS)
    if resume is not None:
        if cfg.from_weights:
            check_fine_tune(cfg, resume)
        return Start(resume, take_architecture(cfg, given, args, resume["model_args"],
                                               f"the checkpoint in {cfg.out_dir}"), None)
    refuse_to_mix(cfg)
    return Start(None, *pretrained(cfg, given, args, meta)) if cfg.from_weights else \
        Start(None, args, None)


def check_fine_tune(cfg, resume):
    """The checkpoint that init_from=<GPT-2's weights> resumes must be of a fine-tune of them:
    of their shape (its vocabulary may be padded), not another run's left in out_dir."""
    keys = ("n_layer", "n_head", "n_embd", "vocab_size")
    theirs, ours = hf.shape(cfg.init_from), tuple(resume["model_args"].get(k) for k in keys)
    if ours[:3] == theirs[:3] and ours[3] is not None and 0 <= ours[3] - theirs[3] < 64:
        return
    data = Saved.of(resume).tokenizer
    raise UserError(
        f"{cfg.out_dir} holds a checkpoint of another model (iter {resume['iter_num']}: "
        f"{', '.join(f'{k}={v}' for k, v in zip(keys, ours))}"
        f"{f', trained on {data!r} tokens' if data else ''}), not a fine-tune of "
        f"{cfg.init_from} ({', '.join(f'{k}={v}' for k, v in zip(keys, theirs))}): "
        f"init_from={cfg.init_from} resumes the checkpoints in its out_dir, so that a restarted "
        f"fine-tune goes on. Give this fine-tune a new out_dir, or use --init_from=resume to "
        f"go on with that run.")


def newest_checkpoint(cfg, whole):
    """out_dir's newest checkpoint that loads, or None; an error for init_from='resume'."""
    state, path = checkpoint.load_latest(cfg.out_dir, whole=whole)
    if state is None and cfg.init_from == "resume":
        raise UserError(f"init_from='resume' but {cfg.out_dir} holds no loadable checkpoint "
                        f"(ckpt_*.pt or ckpt_*/): train from scratch with "
                        f"--init_from=scratch, or use --init_from=auto.")
    if state is not None:
        log.info(f"resuming from {path} (iter {state['iter_num']})")
    return state


def refuse_to_mix(cfg):
    """A fresh start where an earlier run left checkpoints would mix two runs in one out_dir: its
    checkpoints overwritten where the iters meet and left beside the new ones elsewhere (a later
    resume would pick the newest, of either run). nanoGPT would start over; torchrun's and SLURM's
    restarts, and the Ctrl-C line, expect the run to go on: refused, naming both ways."""
    found = checkpoint.list_checkpoints(cfg.out_dir)
    if not found:
        return
    names = ", ".join(os.path.basename(p) for p in found[:3]) + (", ..." if found[3:] else "")
    why = (f"init_from={cfg.init_from!r} would start a new run beside them" if
           cfg.init_from == "scratch" else "none of them loads (see above), and a fresh start "
           "beside them would be a new run")
    raise UserError(
        f"{cfg.out_dir} holds the checkpoints of an earlier run ({names}), and {why}: two runs "
        f"would mix there. To go on with that run: --init_from=resume (or auto, which resumes "
        f"where there is a checkpoint and starts fresh where there is none). To start a new "
        f"one: another --out_dir, or remove those checkpoints first.")


def take_architecture(cfg, given, args, weights_args, source):
    """The model arguments of existing weights (all but dropout, which is the run's), as in nanoGPT.
    An architecture key the user set to another value is an error, not a silent override."""
    theirs = architecture(weights_args)
    conflicts = [f"{k}={getattr(cfg, k)!r} ({theirs[k]!r} there)" for k in ARCHITECTURE
                 if k in given and getattr(cfg, k) != theirs[k]
                 and (k != "rope_theta" or theirs["arch"] == "modern")]
    if conflicts:
        raise UserError(f"{', '.join(conflicts)}: the architecture comes from {source}. Leave "
                        f"these keys out (or set them to the values there), or train from "
                        f"scratch in another out_dir.")
    return {**args, **{k: v for k, v in weights_args.items() if k != "dropout"}}


def pretrained(cfg, given, args, meta):
    """(model_args, weights) of GPT-2's weights (hf.py). As in nanoGPT the architecture is theirs,
    but a smaller block_size crops the position table (the first positions are the same)."""
    weights, weights_args = hf.load(cfg.init_from)
    source, positions = f"the weights of {cfg.init_from}", weights_args["block_size"]
    # the data must be in the weights' tokens. OpenAI's read GPT-2's, and so does a folder of
    # GPT-2's vocabulary size or more (a folder names no tokenizer; sample.py and eval.py read
    # such weights with GPT-2's); a smaller folder's must at least have an embedding for every
    # token id of the data, which opening the data checks (sources.check_fits)
    tokens = (meta or {}).get("tokenizer")
    if (cfg.init_from in NAMES or weights_args["vocab_size"] >= GPT2_VOCAB_SIZE) and \
            tokens not in (None, *GPT2_NAMES):
        ids = f"{weights_args['vocab_size']} token ids, GPT-2's"
        raise UserError(f"{cfg.data_dir} holds {tokens!r} tokens ({meta['vocab_size']} ids), which "
                        f"{source} ({ids}) cannot read: prepare the data with the tokenizer those "
                        f"weights were trained with (--tokenizer=gpt2 for OpenAI's GPT-2).")
    if "block_size" in given and cfg.block_size > positions:
        raise UserError(f"block_size={cfg.block_size} is more than the {positions} positions "
                        f"of {source}: use block_size <= {positions} (a smaller one crops them).")
    if "block_size" in given:
        weights_args["block_size"] = cfg.block_size
        if "transformer.wpe.weight" in weights:  # rotary embeddings (modern) have no table
            weights["transformer.wpe.weight"] = weights["transformer.wpe.weight"][:cfg.block_size]
    return take_architecture(cfg, given, args, weights_args, source), weights


# ---- a resume against this run's data ----

def check_resume(cfg, resume, meta, identity, n_sources):
    """A resume reads the tokens it was trained on, from a whole global batch, in the data it
    was trained on (identity: sources.identity()), unless the user says a change is meant."""
    saved = Saved.of(resume)
    used = saved.tokenizer
    if meta is not None and used is not None and used != meta.get("tokenizer"):
        raise UserError(
            f"the checkpoint was trained on {used!r} tokens but {cfg.data_dir} holds "
            f"{meta.get('tokenizer')!r} tokens: set data_dir to data made with {used!r}.")
    check_same_optimizer(cfg, saved.config)
    old_mix = saved.config.get("data_mix", "")
    if old_mix != cfg.data_mix and (old_mix or n_sources > 1):
        log.info(f"note: data_mix was {old_mix!r} and is now {cfg.data_mix!r}: the run goes on "
                 f"from the same global sample, but which source each sample comes from differs "
                 f"from here on from what the old mixture would have read.")
    old_sampling = saved.config.get("sampling", "epoch")  # before the key: epoch's windows
    if old_sampling != cfg.sampling:
        log.info(f"note: sampling was {old_sampling!r} and is now {cfg.sampling!r}: the run goes "
                 f"on from the same global sample, but from here on its windows are drawn as "
                 f"sampling={cfg.sampling!r} draws them, not in the order it was reading.")
    samples = saved.samples(cfg.global_batch)
    if samples % cfg.global_batch:
        raise UserError(
            f"the checkpoint consumed {samples} samples, not a whole number of global batches "
            f"of {cfg.global_batch} (batch_size x gradient_accumulation_steps): resume with a "
            f"global batch that divides it.")
    what = f"data_mix={cfg.data_mix!r}" if cfg.data_mix else f"data_dir={cfg.data_dir!r}"
    sources.check_same_data(what, saved.data_identity, identity,
                            f"the checkpoint in {cfg.out_dir}", cfg.allow_data_change)
    schedule.check_extension(saved.config, cfg, saved.iter_num, cfg.out_dir)


def check_same_optimizer(cfg, trained):
    """The checkpoint's optimizer state is of the optimizer it was trained with (nanoGPT's and
    older checkpoints: AdamW), over the same parameters: another one cannot load it."""
    was = {"optimizer": trained.get("optimizer", "adamw")}
    if was["optimizer"] == "muon":
        was["muon_params"] = trained.get("muon_params")
    now = {k: getattr(cfg, k) for k in was}
    if was != now:
        changed = ", ".join(f"{k}={now[k]!r} ({was[k]!r} there)" for k in was if was[k] != now[k])
        fix = " ".join(f"--{k}={shlex.quote(v)}" for k, v in was.items())
        raise UserError(f"{changed}: the checkpoint in {cfg.out_dir} holds the state of the "
                        f"optimizer it was trained with, which another one cannot take up. Resume "
                        f"with {fix}, or start a new run in another out_dir.")


# ---- sample.py, eval.py, export.py: a run, a checkpoint file, or GPT-2's weights ----

class Loaded(NamedTuple):
    args: dict  # GPTConfig's arguments
    weights: dict  # for GPT.load_state_dict
    tokenizer: Tokenizer
    source: str  # what was loaded and where its tokenizer came from, for the log
    state: Optional[dict]  # the whole checkpoint, or None for GPT-2's weights


def checkpoint_at(source, hint, whole=checkpoint.TENSORS):
    """(state, path) of a checkpoint file or folder, or of the newest loadable one in an
    out_dir, its tensors of the parts in `whole` read whole; hint says what to give instead."""
    if os.path.isfile(source) or checkpoint.is_folder(source):
        state, problem = checkpoint.read(source, whole)
        if state is None:
            raise UserError(f"{source} {problem}: {hint}")
        return state, source
    state, path = checkpoint.load_latest(source, whole=whole)
    if state is None:
        what = ("holds no loadable checkpoint (ckpt_*.pt, ckpt_*/ or nanoGPT's ckpt.pt)"
                if os.path.isdir(source) else "does not exist")
        raise UserError(f"{source} {what}: {hint}")
    return state, path


def load(init_from, out_dir, hint):
    """Loaded for init_from='resume' (out_dir: a run's folder or one checkpoint file), else for
    Hugging Face weights by name or folder, which read the tokenizer a folder carries
    (hf.folder_tokenizer), else GPT-2's tokens."""
    if init_from == "resume":
        state, path = checkpoint_at(out_dir, hint, whole=("model",))
        meta, where = data_meta(state)
        tok = tokenizer_of(meta, state["model_args"]["vocab_size"])
        return Loaded(state["model_args"], checkpoint.model_state(state), tok,
                      f"{path} (iter {state['iter_num']}), tokenizer {tok.name!r} from {where}",
                      state)
    weights, args = hf.load(init_from)
    named = os.path.isdir(init_from) and hf.folder_tokenizer(init_from)
    tok = get_tokenizer(named or "gpt2")
    whose = "its tokenizer.json" if named else \
        "GPT-2's tokenizer, with which Hugging Face weights without one are read,"
    check_ids_fit(tok.vocab_size, whose, args["vocab_size"], init_from,
                  "use the checkpoint they were exported from, with --out_dir.")
    where = "its tokenizer.json" if named else "Hugging Face weights"
    return Loaded(args, weights, tok, f"{init_from}, tokenizer {tok.name!r} ({where})", None)
