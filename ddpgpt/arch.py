"""The architecture of a model, as numbers and without torch: GPTConfig, from which model.py
builds a GPT (a checkpoint keeps it as model_args), and its two block designs (arch): GPT-2's,
as nanoGPT has it, and the modern block, Qwen3's (model.py describes both). The settings that
choose them (settings.py) take their choices, ranges and checks from here."""
import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

from ddpgpt.errors import UserError
from ddpgpt.tokenfile import GPT2_VOCAB_SIZE

Arch = Literal["gpt2", "modern"]  # the arch key's choices
ARCHES = get_args(Arch)
RMS_EPS = 1e-6  # RMSNorm's epsilon, Qwen3's
# model.rotary() computes theta ** (-i / head_dim) in float32: theta must be finite there, and
# above 1 for frequencies that fall from 1 along a head (1e-300 became 0 ** -x = inf, a NaN loss)
ROPE_THETA_RANGE = {"above": 1, "below": 3.4e38}


def padded(vocab_size):
    """The vocabulary rounded up to a multiple of 64, which GPUs multiply faster (nanoGPT's)."""
    return -(-vocab_size // 64) * 64


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = padded(GPT2_VOCAB_SIZE)  # 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # False: no bias in Linears and LayerNorms, a bit better and faster
    # (GPT-2's only: the modern block has none)
    # nn.GELU's approximate: 'none' is the exact erf form (nanoGPT's, and every checkpoint's
    # that names none); 'tanh' is the approximation GPT-2 itself used, which OpenAI's weights need
    gelu_approximate: str = "none"
    arch: str = "gpt2"  # or 'modern'; checkpoints of a GPT-2 name none
    rope_theta: float = 10000.0  # modern: the base of the rotary embeddings' frequencies

    def __post_init__(self):
        if self.arch not in ARCHES:
            raise ValueError(f"arch={self.arch!r} is none of {ARCHES}")
        if self.n_embd % self.n_head:
            raise UserError(f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")


# the fields that fix what a model is, which weights bring with them and a run's settings must
# not contradict: all but the run's own dropout, and the GELU form that OpenAI's weights alone set
ARCHITECTURE = tuple(f.name for f in dataclasses.fields(GPTConfig)
                     if f.name not in ("dropout", "gelu_approximate"))


def swiglu_hidden(n_embd):
    """The width of the modern MLP: 8/3 of n_embd, rounded to a multiple of 32, so that its
    three matrices hold about as many weights as GPT-2's two of 4 x n_embd (2048 at 768)."""
    return 32 * round(8 * n_embd / 3 / 32)


def check_bias(arch, bias):
    if arch == "modern" and bias:
        raise UserError("bias=True with arch='modern': the modern block has no biases (nor has "
                        "Qwen3's); leave bias out or set it to False.")


def model_args(cfg, meta):
    """GPTConfig's arguments for a model trained from scratch with these settings on data described
    by meta (vocab_size 0: the data's, padded). A GPT-2's are nanoGPT's keys alone, so that nanoGPT
    reads its checkpoints; the modern block's name their arch and rope_theta too."""
    vocab_size = cfg.vocab_size or padded(n_tokens(meta))
    args = dict(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd,
                block_size=cfg.block_size, bias=cfg.bias, dropout=cfg.dropout,
                vocab_size=vocab_size)
    if cfg.arch != "gpt2":
        args.update(arch=cfg.arch, rope_theta=cfg.rope_theta, bias=False)
    return args


def n_tokens(meta):
    """The tokenizer's ids of data described by meta (GPT-2's for raw .bin files)."""
    return GPT2_VOCAB_SIZE if meta is None else meta["vocab_size"]


def architecture(args):
    """The settings that model arguments fix: what train.py's configuration then says. What
    they leave out is GPTConfig's default (arch: a checkpoint that names none is a GPT-2)."""
    every = dataclasses.asdict(GPTConfig(**args))
    return {k: every[k] for k in ARCHITECTURE}
