"""Sample from the newest checkpoint in out_dir (train.py's, or nanoGPT's ckpt.pt; or out_dir is
one checkpoint file), or from GPT-2's weights (a name or a Hugging Face folder):
  python sample.py --out_dir=out-quickstart --start="def " --num_samples=3 --max_new_tokens=200
  python sample.py --init_from=gpt2 --start="The meaning of life is"

Keys as in SampleConfig (ddpgpt/settings.py; `python sample.py --help`). The samples go to
stdout, what was loaded to stderr, so `python sample.py ... > samples.txt` keeps the text only."""
import logging
import sys

from ddpgpt import configurator, cpu
from ddpgpt.settings import SampleConfig

cpu.wait_passively()  # before torch is imported
if __name__ == "__main__":  # a mistyped key ends before torch's import, which takes seconds
    configurator.end_now_if_unreadable(SampleConfig, sys.argv[1:], "sample.py")

import torch  # noqa: E402

from ddpgpt import errors, logs, runtime, weights  # noqa: E402
from ddpgpt.errors import UserError  # noqa: E402
from ddpgpt.model import GPT, GPTConfig  # noqa: E402

log = logging.getLogger("ddpgpt.sample")


def main(argv):
    cfg = configurator.parse(SampleConfig, argv, "sample.py")
    logs.setup(stream=sys.stderr)  # stdout is for the samples alone
    device = runtime.pick_device(cfg.device, runtime.Ranks(0, 0, 1, 1))
    prompt = read_prompt(cfg.start)  # before the checkpoint: a typo should not cost a load
    loaded = weights.load(cfg.init_from, cfg.out_dir,
                          "set --out_dir to where train.py saved, or train a model.")
    log.info(f"sample.py: {loaded.source}")
    tok = loaded.tokenizer
    ids = tok.encode(prompt)
    if not ids:
        raise UserError(f"the prompt {cfg.start!r} is empty, but the model needs at least one "
                        f"token to continue: give --start some text (the default is a newline).")
    model = GPT(GPTConfig(**loaded.args), tok.vocab_size)
    model.load_state_dict(loaded.weights)
    model.eval().to(device)
    if cfg.compile:
        model.compile()  # in place, so that generate()'s calls to the model are compiled too
    x = torch.tensor([ids], dtype=torch.long, device=device)
    torch.manual_seed(cfg.seed)  # seeded here, so the samples depend on the seed alone
    with runtime.precision(cfg.dtype, device).autocast:
        for _ in range(cfg.num_samples):
            y = model.generate(x, cfg.max_new_tokens, cfg.temperature, cfg.top_k or None)
            print(tok.decode(y[0].tolist()))
            print("---------------")
    return 0


def read_prompt(start):
    """The prompt: the text itself, or FILE:path's contents."""
    if not start.startswith("FILE:"):
        return start
    try:
        with open(start[5:], encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read the prompt file {start[5:]!r} ({e}): give --start="
                        f"FILE:<a UTF-8 text file>, or the prompt itself as --start=<text>.")


if __name__ == "__main__":
    sys.exit(errors.run(main, "sample.py", sys.argv[1:]))
