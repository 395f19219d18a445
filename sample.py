"""Sample text from the newest checkpoint in out_dir (train.py's, or nanoGPT's ckpt.pt).

  python sample.py --out_dir=out-quickstart --start="def " --num_samples=3 --max_new_tokens=200
  python sample.py --out_dir=out-owt --start=FILE:prompt.txt --temperature=0.7

Every key is in SampleConfig below; config files and --key=value override it (configurator.py).
The samples go to stdout, each followed by a separator line; what was loaded goes to stderr,
so `python sample.py ... > samples.txt` keeps only the text.
"""
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass

import torch

import checkpoint
import configurator
import data
from model import GPT, GPTConfig
from tokenizer import TokenizerError, get_tokenizer


@dataclass
class SampleConfig:
    out_dir: str = "out"
    start: str = "\n"  # the prompt, or FILE:path to read it from a UTF-8 text file
    num_samples: int = 3
    max_new_tokens: int = 500
    temperature: float = 0.8  # below 1 sharpens the distribution, above 1 flattens it
    top_k: int = 200  # sample among the k likeliest tokens only; 0 keeps them all
    seed: int = 1337
    device: str = "auto"  # 'auto': cuda when it is there, else cpu
    dtype: str = "auto"  # 'auto': bfloat16 on CUDA that has it, else float32
    compile: bool = False


class SampleError(Exception):
    """A problem the user can fix; printed as one paragraph, without a traceback."""


def log(message):
    print(message, file=sys.stderr)  # stdout is for the samples alone


def check_config(cfg):
    dtypes = ("auto", "float32", "bfloat16", "float16")
    if cfg.dtype not in dtypes:
        raise configurator.ConfigError(f"dtype={cfg.dtype!r} is not one of {dtypes}")
    if cfg.temperature <= 0:
        raise configurator.ConfigError(f"temperature={cfg.temperature} must be above 0; "
                                       f"for the likeliest token every time use --top_k=1")
    for key, least in (("num_samples", 1), ("max_new_tokens", 0), ("top_k", 0)):
        if getattr(cfg, key) < least:
            raise configurator.ConfigError(f"{key}={getattr(cfg, key)} must be at least {least}")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise configurator.ConfigError(f"device={cfg.device!r} but this torch sees no CUDA "
                                       f"device: use --device=cpu or --device=auto")


def read_prompt(start):
    if not start.startswith("FILE:"):
        return start
    path = start[len("FILE:"):]
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or e
        raise SampleError(f"cannot read the prompt file {path!r} ({why}): "
                          f"--start=FILE:<path> needs a readable UTF-8 text file; or give the "
                          f"prompt itself as --start=<text>.") from e


def tokenizer_name(state):
    """(name, where it came from). train.py stores the data's meta.json in the checkpoint;
    older checkpoints (nanoGPT's, or ones trained on raw .bin files) have none, so look for the
    meta.json of the data they were trained on, and else assume GPT-2, as nanoGPT does."""
    meta, where = state.get("data_meta"), "the checkpoint's data_meta"
    data_dir = (state.get("config") or {}).get("data_dir")
    if meta is None and data_dir:
        meta, where = data.read_meta(data_dir), os.path.join(data_dir, data.META_NAME)
    if meta and meta.get("tokenizer"):
        return meta["tokenizer"], where
    return "gpt2", "nanoGPT's default, as the checkpoint names none"


def main(argv):
    cfg = configurator.parse(SampleConfig, argv)
    check_config(cfg)
    prompt = read_prompt(cfg.start)  # before the checkpoint: a typo should not cost a load
    state, path = checkpoint.load_latest(cfg.out_dir, log=log)
    if state is None:
        raise SampleError(f"{cfg.out_dir} holds no loadable checkpoint (ckpt_*.pt, or nanoGPT's "
                          f"ckpt.pt): set --out_dir to the folder train.py wrote its checkpoints "
                          f"to, or train a model first.")
    name, where = tokenizer_name(state)
    log(f"sample.py: {path} (iter {state['iter_num']}), tokenizer {name!r} from {where}")
    tok = get_tokenizer(name)
    vocab_size = state["model_args"]["vocab_size"]
    if tok.vocab_size > vocab_size:
        raise SampleError(f"the model in {path} has {vocab_size} token ids but the tokenizer "
                          f"{name!r} ({where}) has {tok.vocab_size}: it was not trained with "
                          f"{name!r}. Put the meta.json of its training data in the "
                          f"data_dir the checkpoint names.")
    ids = tok.encode(prompt)
    if not ids:
        raise SampleError(f"the prompt {cfg.start!r} is empty, and the model needs at least one "
                          f"token to continue: give --start some text (the default is a newline).")

    device = cfg.device if cfg.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    device_type = torch.device(device).type
    dtype = cfg.dtype if cfg.dtype != "auto" else "bfloat16" if (
        device_type == "cuda" and torch.cuda.is_bf16_supported()) else "float32"
    autocast = nullcontext() if dtype == "float32" else torch.autocast(
        device_type, dtype={"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype])
    model = GPT(GPTConfig(**state["model_args"]))
    model.load_state_dict(checkpoint.model_state(state))
    model.eval().to(device)
    if tok.vocab_size < vocab_size:
        # train.py pads the vocabulary to a multiple of 64; the padding ids are no tokens at all,
        # so their logits are masked out before generate() samples
        padding = torch.arange(vocab_size, device=device) >= tok.vocab_size
        model.lm_head.register_forward_hook(
            lambda module, inputs, logits: logits.masked_fill(padding, float("-inf")))
    if cfg.compile:
        model.compile()  # in place, so that generate()'s calls to the model are compiled too

    x = torch.tensor(ids, dtype=torch.long, device=device)[None, :]
    torch.manual_seed(cfg.seed)  # seeded here, so the samples depend on the seed alone
    with autocast:
        for _ in range(cfg.num_samples):
            y = model.generate(x, cfg.max_new_tokens, temperature=cfg.temperature,
                               top_k=cfg.top_k or None)
            print(tok.decode(y[0].tolist()))
            print("---------------")
    return 0


def run_cli(argv):
    try:
        return main(argv)
    except (configurator.ConfigError, SampleError, TokenizerError, data.DataError,
            checkpoint.CheckpointError) as e:
        print(f"sample.py: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(run_cli(sys.argv[1:]))
