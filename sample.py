"""Sample from the newest checkpoint in out_dir (train.py's, or nanoGPT's ckpt.pt; or out_dir is
one checkpoint file), or from GPT-2's weights (a name or a Hugging Face folder; weights.py):
  python sample.py --out_dir=out-quickstart --start="def " --num_samples=3 --max_new_tokens=200
  python sample.py --init_from=gpt2 --start="The meaning of life is"

Keys as in SampleConfig, set by config files and --key=value (configurator.py). The samples go
to stdout, what was loaded to stderr, so `python sample.py ... > samples.txt` keeps the text only.
"""
import functools
import sys
from dataclasses import dataclass

import torch

import configurator
import errors
import hf
import weights
from errors import UserError
from model import GPT, GPTConfig
from startup import Dtype, pick_device, pick_dtype

NO_CHECKPOINT = "set --out_dir to where train.py saved, or train a model."


@dataclass
class SampleConfig:
    init_from: str = "resume"  # resume: out_dir's newest checkpoint; or gpt2... or an HF folder
    out_dir: str = "out"  # a run's out_dir, or one checkpoint file
    start: str = "\n"  # the prompt, or FILE:path to read it from a UTF-8 text file
    num_samples: int = 3
    max_new_tokens: int = 500
    temperature: float = 0.8  # below 1 sharpens the distribution, above 1 flattens it
    top_k: int = 200  # sample among the k likeliest tokens only; 0 keeps them all
    seed: int = 1337
    device: str = "auto"  # 'auto': cuda when it is there, else cpu; as in train.py
    dtype: Dtype = "auto"  # as in train.py
    compile: bool = False


def main(argv):
    cfg = configurator.parse(SampleConfig, argv)
    log = functools.partial(print, file=sys.stderr)  # stdout is for the samples alone
    for key, ok, need in (
            ("temperature", cfg.temperature > 0, "above 0 (--top_k=1 picks the likeliest token)"),
            ("num_samples", cfg.num_samples >= 1, "at least 1"),
            ("max_new_tokens", cfg.max_new_tokens >= 0, "at least 0"),
            ("top_k", cfg.top_k >= 0, "at least 0 (0 keeps all tokens)")):
        if not ok:
            raise UserError(f"{key}={getattr(cfg, key)!r} must be {need}")
    device = pick_device(cfg.device, local_rank=0)
    hf.check_init_from(cfg.init_from, ("resume",))
    prompt = cfg.start
    if prompt.startswith("FILE:"):  # read before the checkpoint: a typo should not cost a load
        try:
            with open(prompt[5:], encoding="utf-8") as f:
                prompt = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read the prompt file {prompt[5:]!r} ({e}): give --start="
                              f"FILE:<a UTF-8 text file>, or the prompt itself as --start=<text>.")
    loaded = weights.load(cfg.init_from, cfg.out_dir, NO_CHECKPOINT, log)
    log(f"sample.py: {loaded.source}")
    tok, vocab_size = loaded.tokenizer, loaded.args["vocab_size"]
    ids = tok.encode(prompt)
    if not ids:
        raise UserError(f"the prompt {cfg.start!r} is empty, but the model needs at least one "
                          f"token to continue: give --start some text (the default is a newline).")

    dtype = pick_dtype(cfg, torch.device(device).type)
    model = GPT(GPTConfig(**loaded.args))
    model.load_state_dict(loaded.weights)
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
    sys.exit(errors.run(main, "sample.py", sys.argv[1:]))
