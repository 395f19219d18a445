"""Sample from the newest checkpoint in out_dir (train.py's, or nanoGPT's ckpt.pt), or from
GPT-2's weights (a name or a Hugging Face folder, hf.py):
  python sample.py --out_dir=out-quickstart --start="def " --num_samples=3 --max_new_tokens=200
  python sample.py --init_from=gpt2 --start="The meaning of life is"

Keys as in SampleConfig, set by config files and --key=value (configurator.py). The samples go
to stdout, what was loaded to stderr, so `python sample.py ... > samples.txt` keeps the text only.
"""
import functools
import os
import sys
from dataclasses import dataclass

import torch

import checkpoint
import configurator
import hf
import tokenfile
import tokenizer
from errors import UserError
from model import GPT, GPTConfig
from train import Dtype, pick_device, pick_dtype


@dataclass
class SampleConfig:
    init_from: str = "resume"  # resume: out_dir's newest checkpoint; or gpt2... or an HF folder
    out_dir: str = "out"
    start: str = "\n"  # the prompt, or FILE:path to read it from a UTF-8 text file
    num_samples: int = 3
    max_new_tokens: int = 500
    temperature: float = 0.8  # below 1 sharpens the distribution, above 1 flattens it
    top_k: int = 200  # sample among the k likeliest tokens only; 0 keeps them all
    seed: int = 1337
    device: str = "auto"  # 'auto': cuda when it is there, else cpu
    dtype: Dtype = "auto"  # as in train.py
    compile: bool = False


def data_tokenizer(state):
    """(tokenizer, where it came from). train.py keeps the data's meta.json (or what nanoGPT's
    meta.pkl holds) in the checkpoint; older checkpoints have none: read their data folder's
    (data_dir, or as nanoGPT's sample.py data/<dataset>), else assume GPT-2's tokens."""
    meta, where = state.get("data_meta"), "the checkpoint's data_meta"
    config = state.get("config") or {}
    data_dir = config.get("data_dir") or (config.get("dataset") and
                                          os.path.join("data", config["dataset"]))
    if meta is None and data_dir:
        meta, where = tokenfile.read_meta(data_dir), tokenfile.meta_path(data_dir)
    if meta and meta.get("tokenizer"):
        return tokenizer.for_data(meta), where
    return tokenizer.get_tokenizer("gpt2"), "nanoGPT's default, as the checkpoint names none"


def load_weights(cfg, log):
    """(model_args, weights, tokenizer) of out_dir's newest checkpoint or of GPT-2's weights,
    which read GPT-2's tokens."""
    if cfg.init_from != "resume":
        weights, args = hf.load(cfg.init_from, log=log)
        gpt2 = tokenizer.get_tokenizer("gpt2")
        if args["vocab_size"] < gpt2.vocab_size:
            raise UserError(
                f"{cfg.init_from} has {args['vocab_size']} token ids, fewer than the "
                f"{gpt2.vocab_size} of GPT-2's tokenizer, with which sample.py reads Hugging Face "
                f"weights: sample the checkpoint they were exported from, with --out_dir.")
        return args, weights, gpt2
    state, path = checkpoint.load_latest(cfg.out_dir, log=log)
    if state is None:
        raise UserError(f"{cfg.out_dir} holds no loadable checkpoint (ckpt_*.pt or nanoGPT's "
                          f"ckpt.pt): set --out_dir to where train.py saved, or train a model.")
    tok, where = data_tokenizer(state)
    log(f"sample.py: {path} (iter {state['iter_num']}), tokenizer {tok.name!r} from {where}")
    return state["model_args"], checkpoint.model_state(state), tok


def main(argv):
    cfg = configurator.parse(SampleConfig, argv)
    log = functools.partial(print, file=sys.stderr)  # stdout is for the samples alone
    for key, ok, need in (
            ("temperature", cfg.temperature > 0, "above 0 (--top_k=1 picks the likeliest token)"),
            ("num_samples", cfg.num_samples >= 1, "at least 1"),
            ("max_new_tokens", cfg.max_new_tokens >= 0, "at least 0"),
            ("top_k", cfg.top_k >= 0, "at least 0 (0 keeps all tokens)"),
            ("device", not cfg.device.startswith("cuda") or torch.cuda.is_available(),
             "'cpu' or 'auto' here: torch sees no CUDA device")):
        if not ok:
            raise UserError(f"{key}={getattr(cfg, key)!r} must be {need}")
    hf.check_init_from(cfg.init_from, ("resume",))
    prompt = cfg.start
    if prompt.startswith("FILE:"):  # read before the checkpoint: a typo should not cost a load
        try:
            with open(prompt[5:], encoding="utf-8") as f:
                prompt = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read the prompt file {prompt[5:]!r} ({e}): give --start="
                              f"FILE:<a UTF-8 text file>, or the prompt itself as --start=<text>.")
    args, weights, tok = load_weights(cfg, log)
    vocab_size = args["vocab_size"]
    if tok.vocab_size > vocab_size:
        raise UserError(f"the model has {vocab_size} token ids, fewer than {tok.name!r}'s "
                          f"{tok.vocab_size}: put its data's meta.json in the data_dir it names.")
    ids = tok.encode(prompt)
    if not ids:
        raise UserError(f"the prompt {cfg.start!r} is empty, but the model needs at least one "
                          f"token to continue: give --start some text (the default is a newline).")

    device = pick_device(cfg, local_rank=0)
    dtype = pick_dtype(cfg, torch.device(device).type)
    model = GPT(GPTConfig(**args))
    model.load_state_dict(weights)
    model.eval().to(device)
    if tok.vocab_size < vocab_size:
        # train.py pads the vocabulary to a multiple of 64 for speed; the padding ids are no
        # tokens (tiktoken cannot decode them), so generate() must never sample them
        padding = torch.arange(vocab_size, device=device) >= tok.vocab_size
        model.lm_head.register_forward_hook(
            lambda module, inputs, logits: logits.masked_fill(padding, float("-inf")))
    if cfg.compile:
        model.compile()  # in place, so that generate()'s calls to the model are compiled too
    x = torch.tensor([ids], dtype=torch.long, device=device)
    torch.manual_seed(cfg.seed)  # seeded here, so the samples depend on the seed alone
    with torch.autocast(torch.device(device).type, getattr(torch, dtype),
                        enabled=dtype != "float32"):
        for _ in range(cfg.num_samples):
            y = model.generate(x, cfg.max_new_tokens, cfg.temperature, cfg.top_k or None)
            print(tok.decode(y[0].tolist()))
            print("---------------")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except UserError as e:
        print(f"sample.py: error: {e}", file=sys.stderr)
        sys.exit(1)
