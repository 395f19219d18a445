"""model.py: shapes, the loss, nanoGPT's parameter names, the optimizer, FLOPs and sampling."""
import math

import pytest
import torch

from ddpgpt import checkpoint, optim
from ddpgpt.model import GPT, GPTConfig

TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)


def tiny(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**TINY, **kw}))


def batch(b=4, t=16, vocab=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (b, t), generator=g)
    return x, torch.randint(0, vocab, (b, t), generator=g)


def test_shapes_with_and_without_targets():
    model = tiny()
    x, y = batch()
    logits, loss = model(x, y)
    assert logits.shape == (4, 16, 64) and loss.dim() == 0
    logits, loss = model(x)
    assert logits.shape == (4, 1, 64) and loss is None
    # inference's last-position logits are the training path's last position
    assert torch.allclose(logits[:, 0], model(x, y)[0][:, -1], atol=1e-6)


@pytest.mark.parametrize("arch", ["gpt2", "modern"])
def test_zero_projections_make_every_block_the_identity(arch):
    """proj_init='zero': with the blocks' output projections at zero, the model computes what
    it computes without its blocks; and only they are zero."""
    model = tiny(arch=arch, bias=False)
    model.zero_projections()
    x, _ = batch()
    with_blocks = model(x)[0]
    zeroed = {n for n, p in model.named_parameters() if not p.any()}
    assert zeroed == {f"transformer.h.{i}.{part}.c_proj.weight" for i in range(2)
                      for part in ("attn", "mlp")}
    model.transformer.h = torch.nn.ModuleList()
    assert torch.equal(with_blocks, model(x)[0])


def test_longer_than_block_size_raises():
    with pytest.raises(ValueError):
        tiny()(torch.zeros(1, 17, dtype=torch.long))


def test_loss_at_init_is_near_uniform():
    _, loss = tiny()(*batch())
    assert abs(loss.item() - math.log(64)) < 0.5


def test_ignore_index_minus_one():
    model = tiny()
    x, y = batch()
    y_masked = y.clone()
    y_masked[:, 8:] = -1
    logits, loss = model(x, y_masked)
    kept = torch.nn.functional.cross_entropy(logits[:, :8].reshape(-1, 64), y[:, :8].reshape(-1))
    assert torch.allclose(loss, kept, atol=1e-6)


@pytest.mark.slow
def test_overfits_one_batch():
    model = tiny()
    x, y = batch()
    opt = optim.make_optimizer(model, 0.0, 1e-2, (0.9, 0.95), "cpu")
    first = model(x, y)[1].item()
    for _ in range(50):
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    last = model(x, y)[1].item()
    assert last < 0.5 * first, (first, last)


def test_weight_tying():
    model = tiny()
    assert model.lm_head.weight is model.transformer.wte.weight
    sd = model.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["transformer.wte.weight"].data_ptr()


def test_causal():
    model = tiny().eval()
    x, y = batch(b=2)
    k = 9
    x2 = x.clone()
    x2[:, k] = (x2[:, k] + 1) % 64
    a, _ = model(x, y)
    b, _ = model(x2, y)
    assert torch.allclose(a[:, :k], b[:, :k], atol=1e-6)
    assert not torch.allclose(a[:, k:], b[:, k:], atol=1e-6)


def test_gpt2_init():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_head=2, n_embd=64, block_size=16, vocab_size=256))
    blk = model.transformer.h[0]
    assert blk.attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert blk.mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert model.transformer.wpe.weight.std().item() == pytest.approx(0.02, rel=0.1)
    residual_std = 0.02 / math.sqrt(2 * 4)
    assert blk.attn.c_proj.weight.std().item() == pytest.approx(residual_std, rel=0.1)
    assert blk.mlp.c_proj.weight.std().item() == pytest.approx(residual_std, rel=0.1)
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            assert torch.all(p == 0), name


# nanoGPT's names and shapes for n_layer=1, n_embd=C, vocab V, block_size T, bias=True
C, V, T = 32, 64, 16
NANOGPT_KEYS = {
    "transformer.wte.weight": (V, C), "transformer.wpe.weight": (T, C),
    "transformer.h.0.ln_1.weight": (C,), "transformer.h.0.ln_1.bias": (C,),
    "transformer.h.0.attn.c_attn.weight": (3 * C, C), "transformer.h.0.attn.c_attn.bias": (3 * C,),
    "transformer.h.0.attn.c_proj.weight": (C, C), "transformer.h.0.attn.c_proj.bias": (C,),
    "transformer.h.0.ln_2.weight": (C,), "transformer.h.0.ln_2.bias": (C,),
    "transformer.h.0.mlp.c_fc.weight": (4 * C, C), "transformer.h.0.mlp.c_fc.bias": (4 * C,),
    "transformer.h.0.mlp.c_proj.weight": (C, 4 * C), "transformer.h.0.mlp.c_proj.bias": (C,),
    "transformer.ln_f.weight": (C,), "transformer.ln_f.bias": (C,),
    "lm_head.weight": (V, C),
}


def test_state_dict_matches_nanogpt():
    sd = tiny(n_layer=1).state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == NANOGPT_KEYS


def test_no_bias_drops_bias_keys():
    sd = tiny(n_layer=1, bias=False).state_dict()
    assert set(sd) == {k for k in NANOGPT_KEYS if not k.endswith(".bias")}


def test_loads_a_compiled_checkpoint():
    src = tiny(n_layer=1)
    # what torch.compile'd nanoGPT training saves
    ckpt = {"model": {"_orig_mod." + k: v.clone() for k, v in src.state_dict().items()}}
    dst = GPT(GPTConfig(**{**TINY, "n_layer": 1}))
    dst.load_state_dict(checkpoint.model_state(ckpt))
    x, y = batch()
    assert torch.equal(src(x, y)[0], dst(x, y)[0])
    assert dst.lm_head.weight is dst.transformer.wte.weight


def test_optimizer_groups():
    model = tiny()
    opt = optim.make_optimizer(model, 0.1, 3e-4, (0.9, 0.95), "cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    params = list(model.parameters())  # the tied matrix once
    assert {id(p) for p in decay["params"]} == {id(p) for p in params if p.dim() >= 2}
    assert {id(p) for p in no_decay["params"]} == {id(p) for p in params if p.dim() < 2}
    assert len(decay["params"]) + len(no_decay["params"]) == len(params)
    assert decay["lr"] == 3e-4 and decay["betas"] == (0.9, 0.95)
    assert not opt.defaults["fused"]
    assert optim.make_optimizer(model, 0.1, 3e-4, (0.9, 0.95), "cuda").defaults["fused"]


def test_num_params_and_flops_per_token():
    model = tiny()
    L, H, C, V, T = 2, 2, 32, 64, 16
    per_layer = 12 * C * C + 13 * C  # c_attn, attn.c_proj, c_fc, mlp.c_proj, two LayerNorms
    n_all = V * C + T * C + L * per_layer + 2 * C  # wte (= lm_head), wpe, blocks, ln_f
    assert model.get_num_params(non_embedding=False) == n_all
    n = n_all - T * C
    assert model.get_num_params() == n == 27520
    assert model.flops_per_token() == 6 * n + 12 * L * H * (C // H) * T == 177408


def test_crop_block_size():
    model = tiny()
    model.crop_block_size(8)
    assert model.config.block_size == 8 and model.transformer.wpe.weight.shape == (8, 32)
    x, y = batch(t=8)
    assert model(x, y)[0].shape == (4, 8, 64)
    with pytest.raises(ValueError):
        model(*batch(t=9))
    with pytest.raises(ValueError):
        model.crop_block_size(16)


def test_generate_length_and_context_crop():
    model = tiny().eval()
    idx = torch.zeros(2, 3, dtype=torch.long)
    out = model.generate(idx, 20)  # runs past block_size=16, so the context is cropped
    assert out.shape == (2, 23) and torch.equal(out[:, :3], idx)
    assert out.min() >= 0 and out.max() < 64


def test_generate_top_k_1_is_greedy():
    model = tiny().eval()
    idx = torch.tensor([[1, 2, 3]])
    torch.manual_seed(1)
    a = model.generate(idx, 10, temperature=0.7, top_k=1)
    torch.manual_seed(2)
    b = model.generate(idx, 10, temperature=0.7, top_k=1)
    assert torch.equal(a, b)
    greedy = idx
    for _ in range(10):
        logits, _ = model(greedy)
        greedy = torch.cat((greedy, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(a, greedy)


def test_generate_rejects_bad_temperature_and_top_k():
    model = tiny().eval()
    idx = torch.zeros(1, 1, dtype=torch.long)
    for t in (0.0, -1.0):
        with pytest.raises(ValueError):
            model.generate(idx, 1, temperature=t)
    with pytest.raises(ValueError):
        model.generate(idx, 1, top_k=0)


def test_dropout_train_vs_eval():
    model = tiny(dropout=0.5)
    x, y = batch()
    model.train()
    torch.manual_seed(1)
    a, _ = model(x, y)
    torch.manual_seed(2)
    b, _ = model(x, y)
    assert not torch.allclose(a, b)
    model.eval()
    c, _ = model(x, y)
    d, _ = model(x, y)
    assert torch.equal(c, d)
    # in eval mode dropout is the identity: same weights with dropout=0 give the same logits
    plain = GPT(GPTConfig(**TINY))
    plain.load_state_dict(model.state_dict())
    assert torch.allclose(c, plain.train()(x, y)[0], atol=1e-6)
