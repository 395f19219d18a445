"""GPT-2, as nanoGPT defines it.

Parameter names follow nanoGPT exactly, so its checkpoints load with model.load_state_dict(sd)
once a torch.compile '_orig_mod.' prefix is stripped from the keys.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64, faster matmuls
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # False: no bias in Linears and LayerNorms, a bit better and faster
    # nn.GELU's approximate: 'none' is the exact erf form (nanoGPT's, and every checkpoint's
    # that names none); 'tanh' is the approximation GPT-2 itself used, which OpenAI's weights need
    gelu_approximate: str = "none"


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        if config.n_embd % config.n_head != 0:
            raise ValueError(f"n_embd={config.n_embd} is not a multiple of n_head={config.n_head}")
        # one matmul for query, key and value of all heads
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim): the heads become a batch dimension
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        # the fused kernel never materialises the T x T attention matrix
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate=config.gelu_approximate)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-norm: the residual stream itself is never normalised, which keeps deep stacks stable."""

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # weight tying: one matrix embeds tokens and scores them, as in GPT-2
        self.transformer.wte.weight = self.lm_head.weight

        self.apply(self._init_weights)
        # every block adds two residual projections to the stream; scaling them down keeps
        # the stream's variance from growing with depth (GPT-2 paper)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def get_num_params(self, non_embedding=True):
        """Parameter count, the tied matrix once. The position embeddings are left out by
        default; the token embeddings stay in because, tied, they are also the output layer."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(self, idx, targets=None):
        """idx, targets: (B, T) token ids, T <= block_size; targets of -1 are not scored.
        With targets: (logits (B, T, vocab_size), mean cross-entropy loss).
        Without: (logits (B, 1, vocab_size) for the last position only, None), which spares
        inference the vocabulary-sized matmul at every other position."""
        b, t = idx.size()
        if t > self.config.block_size:
            raise ValueError(f"sequence of length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)

        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)

        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])  # a list index keeps the time dimension
            loss = None
        return logits, loss

    def crop_block_size(self, block_size):
        """Shrink the context length, e.g. to fine-tune a 1024-token checkpoint at 256."""
        if block_size > self.config.block_size:
            raise ValueError(f"cannot grow block_size {self.config.block_size} to {block_size}")
        self.config.block_size = block_size
        wpe = self.transformer.wpe
        wpe.weight = nn.Parameter(wpe.weight[:block_size].detach().clone())
        wpe.num_embeddings = block_size

    def flops_per_token(self):
        """Training FLOPs per token (forward and backward), PaLM paper appendix B:
        6 per parameter plus the attention scores and their weighted sum over block_size keys.
        MFU = flops_per_token() * tokens_per_second / the device's peak FLOP/s."""
        cfg = self.config
        head_dim = cfg.n_embd // cfg.n_head
        return 6 * self.get_num_params() + 12 * cfg.n_layer * cfg.n_head * head_dim * cfg.block_size

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Append max_new_tokens sampled tokens to idx (B, T) and return it (B, T + max_new_tokens).
        temperature > 0 scales the logits (below 1: sharper); top_k keeps only the k likeliest
        tokens, so top_k=1 is greedy decoding. Call model.eval() first unless dropout is wanted."""
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}; use top_k=1 for greedy")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
        for _ in range(max_new_tokens):
            # the model has position embeddings for block_size tokens only
            idx_cond = idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx
