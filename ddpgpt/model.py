"""GPT-2, as nanoGPT defines it, and a modern block (arch='modern'), built from the numbers of a
GPTConfig (arch.py).

Parameter names follow nanoGPT exactly, so its checkpoints load with model.load_state_dict(sd)
once a torch.compile '_orig_mod.' prefix is stripped from the keys.

arch='modern' is the block of today's open models, Qwen3's exactly (hf.py exports it as
transformers' Qwen3ForCausalLM): RMSNorm instead of LayerNorm, rotary position embeddings
instead of a learned table, RMSNorm on each head's queries and keys (QK-norm), a SwiGLU MLP,
no biases, and an output head of its own. Its parameters keep nanoGPT's names where there is
one (wte, h.N.ln_1, attn.c_proj, mlp.c_fc, ln_f, lm_head); the rest are attn.c_q, c_k, c_v
(separate matrices, which Muon orthogonalises one by one), attn.q_norm, k_norm and mlp.c_gate."""
import math

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

# GPTConfig is imported with GPT, as from nanoGPT's model.py
from ddpgpt.arch import RMS_EPS, GPTConfig, swiglu_hidden  # noqa: F401


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
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


def rotary(t, head_dim, theta, device):
    """(cos, sin), each (t, head_dim), of rotary embeddings at positions 0..t-1, in Hugging
    Face's layout: the frequencies of the first half of a head repeated for the second half.
    Computed in every forward, not kept in a buffer: a few thousand numbers, and a buffer would
    be one more tensor for DDP to broadcast at each forward."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                            device=device) / head_dim)
    freqs = torch.outer(torch.arange(t, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def rotate(x, cos, sin):
    """x (B, n_head, T, head_dim) with each pair (i, i + head_dim/2) rotated by its angle."""
    half = x.size(-1) // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + turned * sin.to(x.dtype)


def norm_heads(norm, x):
    """norm(x) computed in float32, as Qwen3 does, and returned in x's dtype: under autocast
    the heads come out of their matmul in bfloat16 (or float16), and under fsdp in bfloat16
    RMSNorm's gain is gathered in bfloat16; a mix of dtypes its fused kernel refuses."""
    return F.rms_norm(x.float(), norm.normalized_shape, norm.weight.float(), norm.eps).to(x.dtype)


class RotaryAttention(nn.Module):
    """The modern attention: queries, keys and values from three matrices, each head's
    queries and keys RMS-normalised (QK-norm keeps the attention logits bounded, so a high
    learning rate does not blow them up), then rotated by their position."""

    def __init__(self, config):
        super().__init__()
        C, head_dim = config.n_embd, config.n_embd // config.n_head
        self.c_q = nn.Linear(C, C, bias=False)
        self.c_k = nn.Linear(C, C, bias=False)
        self.c_v = nn.Linear(C, C, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=RMS_EPS)
        self.k_norm = nn.RMSNorm(head_dim, eps=RMS_EPS)
        self.c_proj = nn.Linear(C, C, bias=False)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x, cos, sin):
        B, T, C = x.size()
        heads = (B, T, self.n_head, C // self.n_head)
        q = rotate(norm_heads(self.q_norm, self.c_q(x).view(heads)).transpose(1, 2), cos, sin)
        k = rotate(norm_heads(self.k_norm, self.c_k(x).view(heads)).transpose(1, 2), cos, sin)
        v = self.c_v(x).view(heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class SwiGLU(nn.Module):
    """The modern MLP: silu(x W_gate) * (x W_fc), projected back (c_proj)."""

    def __init__(self, config):
        super().__init__()
        hidden = swiglu_hidden(config.n_embd)
        self.c_gate = nn.Linear(config.n_embd, hidden, bias=False)
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=False)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.silu(self.c_gate(x)) * self.c_fc(x)))


class ModernBlock(nn.Module):
    """Pre-norm, as Block, with RMSNorm; cos and sin are the positions' rotary embeddings."""

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.RMSNorm(config.n_embd, eps=RMS_EPS)
        self.attn = RotaryAttention(config)
        self.ln_2 = nn.RMSNorm(config.n_embd, eps=RMS_EPS)
        self.mlp = SwiGLU(config)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.ln_1(x), cos, sin)
        return x + self.mlp(self.ln_2(x))


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
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    loss_chunks = 1  # the training loss's slices of positions (chunked_loss); 1: one piece

    def __init__(self, config, n_tokens=None):
        """n_tokens: the tokenizer's ids, where vocab_size pads them (arch.padded); the loss and
        generate() give the ids past them no probability, as an export has no such rows."""
        super().__init__()
        self.config, self.n_tokens = config, n_tokens or config.vocab_size
        self.modern = config.arch == "modern"
        # built in nanoGPT's order, which the random initialisation follows
        layers = dict(wte=nn.Embedding(config.vocab_size, config.n_embd))
        if not self.modern:  # the modern block rotates queries and keys by position instead
            layers["wpe"] = nn.Embedding(config.block_size, config.n_embd)
        layers["drop"] = nn.Dropout(config.dropout)
        layers["h"] = nn.ModuleList([(ModernBlock if self.modern else Block)(config)
                                     for _ in range(config.n_layer)])
        layers["ln_f"] = nn.RMSNorm(config.n_embd, eps=RMS_EPS) if self.modern else \
            nn.LayerNorm(config.n_embd, bias=config.bias)
        self.transformer = nn.ModuleDict(layers)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if not self.modern:
            # weight tying: one matrix embeds tokens and scores them, as in GPT-2
            self.transformer.wte.weight = self.lm_head.weight

        self.apply(self._init_weights)
        # every block adds two residual projections to the stream; scaling them down keeps
        # the stream's variance from growing with depth (GPT-2 paper)
        for p in self.projections():
            nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def projections(self):
        """The blocks' output projections: the two weights each adds to the residual stream."""
        return [p for name, p in self.named_parameters() if name.endswith("c_proj.weight")]

    def zero_projections(self):
        """The blocks' output projections at zero (proj_init='zero', modded-nanogpt's): each
        block adds nothing to the residual stream until it has learnt something to add."""
        for p in self.projections():
            nn.init.zeros_(p)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def get_num_params(self, non_embedding=True):
        """Parameter count, the tied matrix once. The embeddings that are only looked up are
        left out by default: GPT-2's position table (its token embeddings stay in because,
        tied, they are also the output layer), the modern model's token embeddings (its head
        is a matrix of its own, and stays in)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= (self.transformer.wte if self.modern else self.transformer.wpe).weight.numel()
        return n

    def forward(self, idx, targets=None):
        """idx, targets: (B, T) token ids, T <= block_size; targets of -1 are not scored.
        With targets: (logits (B, T, vocab_size), mean cross-entropy loss); in training with
        loss_chunks > 1 (recompute.apply sets it), (None, that loss from chunked_loss).
        Without: (logits (B, 1, vocab_size) for the last position only, None), which spares
        inference the vocabulary-sized matmul at every other position."""
        b, t = idx.size()
        if t > self.config.block_size:
            raise ValueError(f"sequence of length {t} exceeds block_size {self.config.block_size}")
        x, positions = self.transformer.wte(idx), ()
        if self.modern:
            positions = rotary(t, self.config.n_embd // self.config.n_head,
                               self.config.rope_theta, idx.device)
        else:
            x = x + self.transformer.wpe(torch.arange(0, t, dtype=torch.long, device=idx.device))
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            x = block(x, *positions)
        x = self.transformer.ln_f(x)

        if targets is not None and self.training and self.loss_chunks > 1:
            return None, chunked_loss(self.scores, x, targets, self.loss_chunks)
        if targets is None:  # the last position: a list index keeps the time dimension
            return self.scores(x[:, [-1], :]), None
        logits = self.scores(x)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                       ignore_index=-1)

    def scores(self, x):
        """The output layer's logits, -inf at the padding ids (in place: the matmul's backward
        does not read its output)."""
        logits = self.lm_head(x)
        if self.n_tokens < logits.size(-1):
            logits[..., self.n_tokens:] = float("-inf")
        return logits

    def crop_block_size(self, block_size):
        """Shrink the context length, e.g. to fine-tune a 1024-token checkpoint at 256."""
        if block_size > self.config.block_size:
            raise ValueError(f"cannot grow block_size {self.config.block_size} to {block_size}")
        self.config.block_size = block_size
        if self.modern:  # rotary embeddings have no table to crop
            return
        wpe = self.transformer.wpe
        wpe.weight = nn.Parameter(wpe.weight[:block_size].detach().clone())
        wpe.num_embeddings = block_size

    def flops_per_token(self):
        """Training FLOPs per token (forward and backward), PaLM paper appendix B:
        6 per parameter plus the attention scores and their weighted sum over block_size keys.
        The parameters are get_num_params()'s: every matrix a token is multiplied by (and the
        norms' gains, a rounding error); elementwise work (norms, GELU or SwiGLU's product, the
        rotations) is not counted, for either arch, as PaLM and nanoGPT do not.
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
            # the tokens' logits alone: sampled as an export's, which has no padding rows
            logits = logits[:, -1, :self.n_tokens] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                # masked_fill, not logits[mask] = ...: indexing with a mask waits for the GPU
                logits = logits.masked_fill(logits < v[:, [-1]], -float("inf"))
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


def chunked_loss(head, x, targets, chunks):
    """The mean cross-entropy of head(x) against targets (-1: not scored), computed in `chunks`
    slices of the positions, each checkpointed, so that the logits and their gradient take
    1/chunks of the memory (docs/fsdp.md, "The logits", has the cost). Not torch 2.13's chunked
    F.linear_cross_entropy: it keeps the head's weight gradient from its forward (bench
    recompute's activations 91 -> 225 MiB at GPT-2's), ignores autocast, sums a bfloat16
    loss in bfloat16 (11.5 for 11.757), and has no DTensor rule for fsdp's sharded head."""
    x, targets = x.reshape(-1, x.size(-1)), targets.reshape(-1)

    def summed(xs, ts):
        return F.cross_entropy(head(xs), ts, ignore_index=-1, reduction="sum")

    total = sum(checkpoint(summed, xs, ts, use_reentrant=False)
                for xs, ts in zip(x.chunk(chunks), targets.chunk(chunks)))
    return total / (targets != -1).sum()
