"""optimizer=muon and arch=modern, as a user runs them: Muon's groups and schedule, the modern
block as transformers' Qwen3ForCausalLM (export, logits, loading it back), eval.py, sample.py
and the Lightning example on it, float16's GradScaler, and the combinations that cannot
work (Muon's resumes: test_muon.py)."""
import json
import os
import shutil

import pytest
import torch

# read when transformers is imported: never the network. transformers is imported in the tests
# that use it, not here: each pytest-xdist worker imports every test file to collect it, and
# transformers' Qwen3 costs ~7 CPU s, for the worker that runs this file only
os.environ["HF_HUB_OFFLINE"] = "1"

from conftest import TINY, evals, fails, python, stdlib_data, steps
from ddpgpt import checkpoint, hf, optim, schedule
from ddpgpt.errors import UserError
from ddpgpt.model import GPT, GPTConfig, swiglu_hidden
from ddpgpt.settings import TrainConfig

MODERN = ["--arch=modern", "--optimizer=muon"]
SMALL = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, bias=False)


def modern(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**SMALL, "arch": "modern", **kw}))


def perturbed(model):
    """Every parameter moved off its initial value: RMSNorm gains start at 1, which would hide
    a gain mapped to the wrong place."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def random_ids(t, vocab_size=64):
    return torch.randint(0, vocab_size, (2, t), generator=torch.Generator().manual_seed(1))


# ---- the model and the optimizer, in the library ----

def test_the_modern_block_names_counts_and_flops():
    model = modern()
    L, H, C, V, T, F = 2, 2, 32, 64, 16, swiglu_hidden(32)
    per_layer = {"ln_1.weight": (C,), "attn.c_q.weight": (C, C), "attn.c_k.weight": (C, C),
                 "attn.c_v.weight": (C, C), "attn.q_norm.weight": (C // H,),
                 "attn.k_norm.weight": (C // H,), "attn.c_proj.weight": (C, C),
                 "ln_2.weight": (C,), "mlp.c_gate.weight": (F, C), "mlp.c_fc.weight": (F, C),
                 "mlp.c_proj.weight": (C, F)}
    expected = {"transformer.wte.weight": (V, C), "transformer.ln_f.weight": (C,),
                "lm_head.weight": (V, C),
                **{f"transformer.h.{i}.{k}": s for i in range(L) for k, s in per_layer.items()}}
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == expected
    assert model.lm_head.weight is not model.transformer.wte.weight  # untied
    assert F == 96 and swiglu_hidden(768) == 2048  # 2048: GPT-2 124M's MLP weights exactly
    # the head counts, the embedding (a lookup) does not; the norms' gains are counted too
    n = L * (4 * C * C + 3 * C * F + 2 * C + 2 * (C // H)) + C + V * C
    assert model.get_num_params() == n and model.get_num_params(False) == n + V * C
    assert model.flops_per_token() == 6 * n + 12 * L * H * (C // H) * T


def test_the_modern_block_is_qwen3_both_ways_exactly():
    from transformers import Qwen3ForCausalLM
    ours = perturbed(modern(block_size=64))
    args = {**SMALL, "block_size": 64, "arch": "modern", "rope_theta": 10000.0}
    theirs = Qwen3ForCausalLM(hf.qwen3_config_of(args, 64, 63)).eval()
    theirs.load_state_dict(hf.to_qwen3_state(ours.state_dict(), 64))  # strict: every name
    ids = random_ids(64)
    with torch.no_grad():
        assert (ours(ids, ids)[0] - theirs(ids).logits).abs().max().item() < 1e-5
    assert hf.qwen3_args_of(theirs.config) == args
    back = hf.from_qwen3_state(theirs.state_dict())
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())
    ours.crop_block_size(32)  # rotary positions: nothing to crop but the limit
    short = ids[:, :32].contiguous()
    with torch.no_grad():
        assert torch.allclose(ours(short, short)[0], theirs(short).logits, atol=1e-5)


def test_muon_steps_the_blocks_matrices_and_adamw_the_rest():
    for arch in ("gpt2", "modern"):
        model = modern(arch=arch)
        cfg = TrainConfig(optimizer="muon", arch=arch, learning_rate=2e-3, muon_lr=0.04,
                          warmup_iters=0, lr_decay_iters=10, min_lr=2e-4)
        opt = optim.make(cfg, model, "cpu")
        names = {id(p): n for n, p in model.named_parameters()}
        muon = {names[id(p)] for g in opt.muon.param_groups for p in g["params"]}
        adamw = {names[id(p)] for g in opt.adamw.param_groups for p in g["params"]}
        assert muon == {n for n, p in model.named_parameters()
                        if n.startswith("transformer.h.") and p.dim() == 2}
        assert adamw == set(names.values()) - muon  # the embeddings, the head, the norms
        assert opt.muon.defaults["momentum"] == 0.95 and opt.muon.defaults["nesterov"]
        for it in (0, 5, 10):
            lr = optim.set_lr(opt, cfg, it)
            assert lr == schedule.lr_at(cfg, it)
            assert all(g["lr"] == lr for g in opt.adamw.param_groups)
            assert all(g["lr"] == pytest.approx(0.04 * lr / 2e-3) for g in opt.muon.param_groups)
    # the default optimizer is exactly today's AdamW
    model = modern(arch="gpt2")
    adamw = optim.make(TrainConfig(), model, "cpu")
    assert isinstance(adamw, torch.optim.AdamW)
    assert [len(g["params"]) for g in adamw.param_groups] == [
        len(g["params"]) for g in optim.make_optimizer(model, 0.1, 6e-4, (0.9, 0.95),
                                                       "cpu").param_groups]


def test_muon_params_that_name_a_norm_or_nothing_are_user_errors():
    model = modern()
    with pytest.raises(UserError, match=r"gives Muon transformer.h.0.ln_1.weight \(32,\), .*"
                                        r"orthogonalises 2-D updates only"):
        optim.muon_parameters(model, "transformer.h.*")
    with pytest.raises(UserError, match="'lm_head.weights' matches no parameter"):
        optim.muon_parameters(model, "transformer.h.*.c_*.weight, lm_head.weights")
    assert len(optim.muon_parameters(model, "transformer.h.*.c_*.weight,lm_head.weight")) == 15
    # GPT-2's output layer is its token embedding: said so (was: 'matches no parameter')
    torch.manual_seed(0)
    gpt2 = GPT(GPTConfig(**SMALL))
    with pytest.raises(UserError, match=r"'lm_head.weight' names lm_head.weight, which is tied "
                                        r"to transformer.wte.weight: one matrix"):
        optim.muon_parameters(gpt2, "transformer.h.*.c_*.weight,lm_head.weight")


# ---- float16 ----

@pytest.mark.slow
def test_float16_gradient_scaling_steps_muon_and_resumes(env, corpus, tmp_path):
    out = tmp_path / "out"
    args = [f"--data_dir={corpus}", f"--out_dir={out}", *TINY, *MODERN, "--dtype=float16",
            "--gradient_accumulation_steps=2", "--eval_interval=3"]
    python("train.py", *args, "--max_iters=3", env=env)
    python("train.py", *args, "--max_iters=6", "--init_from=resume", env=env)
    rows = steps(out)
    assert sorted(rows) == list(range(6)) and rows[5]["loss"] < rows[0]["loss"]
    state, _ = checkpoint.load_latest(str(out))
    assert state["scaler"]["scale"] > 0 and state["config"]["dtype"] == "float16"


# ---- Hugging Face: export, load back, eval.py and sample.py ----

@pytest.fixture(scope="module")
def gpt2_data(tmp_path_factory, session_env):
    """A few standard-library modules in GPT-2's tokens."""
    return stdlib_data(tmp_path_factory.mktemp("gpt2_data"), ("argparse", "shutil"), "gpt2",
                       session_env)


@pytest.mark.slow
def test_export_is_a_qwen3_that_transformers_loads_and_init_from_loads_back(
        gpt2_data, tmp_path, env):
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM
    out, dest, tuned = tmp_path / "out", tmp_path / "exported", tmp_path / "tuned"
    run = [f"--data_dir={gpt2_data}", *TINY, "--gradient_accumulation_steps=1",
           "--eval_interval=2", "--max_iters=2"]
    # the run ends with its weights' average over both steps, which is what is exported
    p = python("train.py", *run, *MODERN, f"--out_dir={out}", "--rope_theta=500000",
               "--ema_tail=1", "--ema_decay=0.5", env=env)
    assert "the weights are now their average over the last 2 steps (ema_tail)" in p.stdout
    exported = python("export.py", f"--out_dir={out}", f"--to={dest}", env=env)
    config = json.loads((dest / "config.json").read_text())
    assert config["model_type"] == "qwen3" and "auto_map" not in config  # no remote code
    assert config["rope_parameters"]["rope_theta"] == 500000
    theirs = AutoModelForCausalLM.from_pretrained(dest).eval()
    assert isinstance(theirs, Qwen3ForCausalLM) and theirs.config.vocab_size == 50257
    state, _ = checkpoint.load_latest(str(out))
    ours = GPT(GPTConfig(**state["model_args"]))
    ours.load_state_dict(checkpoint.model_state(state))
    averages = [s["ema"] for part in ("muon", "adamw")
                for s in state["optimizer"][part]["state"].values()]
    assert len(averages) == len(list(ours.parameters())) and all(
        any(torch.equal(p, a) for a in averages) for p in ours.parameters())
    ids = random_ids(32, vocab_size=50257)
    with torch.no_grad():
        diff = (ours.eval()(ids, ids)[0][..., :50257] - theirs(ids).logits).abs().max().item()
    assert diff <= 1e-4
    assert AutoTokenizer.from_pretrained(dest).eos_token_id == 50256  # GPT-2's, as for GPT-2
    assert "Qwen3's block" in (dest / "README.md").read_text()

    # back in: fine-tuned like GPT-2's weights, from the run's function exactly (its first
    # evaluation is the run's last, on the same windows), and sampled like them
    p = python("train.py", *run, f"--init_from={dest}", f"--out_dir={tuned}", env=env)
    assert f"loaded the Qwen3 (arch='modern') weights of {dest}" in p.stdout
    assert "arch = 'modern'" in p.stdout and "rope_theta = 500000.0" in p.stdout
    tuned_state, _ = checkpoint.load_latest(str(tuned))
    assert tuned_state["model_args"]["vocab_size"] == 50257
    first = evals(tuned)[0]
    assert first["iter"] == 0
    assert first["val_loss"] == pytest.approx(evals(out)[-1]["val_loss"], rel=1e-5)
    p = python("sample.py", f"--init_from={dest}", "--start=def ", "--num_samples=1",
               "--max_new_tokens=5", env=env)
    assert p.stdout.startswith("def ")
    # transformers' progress bars, over a model's few tensors, came after our lines
    assert not {"Writing model shards", "Loading weights"} & {
        line.split(":")[0] for line in (exported.stderr + p.stderr).splitlines()}


@pytest.fixture(scope="module")
def modern_run(corpus, tmp_path_factory, session_env):
    """out_dir of 4 steps of the modern block under Muon on 1 process, evaluated and saved at
    4: trained once, read by eval.py and sample.py, and copied by the test that resumes it."""
    out = tmp_path_factory.mktemp("modern_run") / "out"
    python("train.py", f"--data_dir={corpus}", f"--out_dir={out}", *TINY, *MODERN,
           "--gradient_accumulation_steps=1", "--max_iters=4", "--eval_interval=4",
           env=session_env)
    return out


@pytest.mark.slow
def test_eval_sample_and_lightning_with_the_modern_block(modern_run, corpus, tmp_path, env):
    out = modern_run
    trained = evals(out)[-1]
    p = python("eval.py", f"--out_dir={out}", f"--data_dir={corpus}", "--hellaswag=False",
               "--eval_iters=4", "--batch_size=4", env=env)
    assert json.loads(p.stdout.splitlines()[-1])["val_loss"] == pytest.approx(
        trained["val_loss"], rel=1e-6)
    p = python("sample.py", f"--out_dir={out}", "--start=def ", "--num_samples=1",
               "--max_new_tokens=40", env=env)  # longer than block_size: the context slides
    assert p.stdout.startswith("def ")
    lightning = tmp_path / "lightning"
    python("examples/lightning_datamodule.py", f"--data_dir={corpus}", f"--out_dir={lightning}",
           "--arch=modern", "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32",
           "--batch_size=4", "--max_steps=3", "--checkpoint_interval=3", "--num_workers=0",
           env=env)
    assert sorted(steps(lightning)) == [0, 1, 2]
    state = torch.load(lightning / "last.ckpt", map_location="cpu", weights_only=True)
    assert "model.lm_head.weight" in state["state_dict"] and \
        "model.transformer.h.0.attn.c_q.weight" in state["state_dict"]


# ---- what cannot work ----

@pytest.mark.parametrize("args, message", [
    (["--arch=modern", "--init_from=gpt2"], "arch='modern' with init_from='gpt2': OpenAI's "
                                            "GPT-2 weights are arch='gpt2'"),
    (["--arch=modern", "--bias=True"], "bias=True with arch='modern': the modern block has no "
                                       "biases"),
    # muon_params naming a norm or nothing: the same optim.muon_parameters's errors, in
    # test_muon_params_that_name_a_norm_or_nothing_are_user_errors
    (["--optimizer=muon", "--muon_params= ,"], "names no parameter for Muon"),
    (["--optimizer=muon", "--learning_rate=0"], "optimizer='muon' with learning_rate=0"),
    (["--rope_theta=500000", "--max_iters=1"],
     "rope_theta=500000.0 is a setting of arch='modern', and this run is arch='gpt2': add "
     "--arch=modern, or leave rope_theta out."),
    (["--muon_ns_dtype=float32", "--muon_lr=0.5"],
     "muon_lr=0.5 is a setting of optimizer='muon', and this run is optimizer='adamw': add "
     "--optimizer=muon, or leave muon_lr out."),
    (["--arch=modern", "--rope_theta=1e300"], "rope_theta=1e+300 must be above 1 and below "
                                              "3.4e+38 (rope_theta: modern: the base of"),
    (["--arch=modern", "--rope_theta=1e-300"], "rope_theta=1e-300 must be above 1 and below"),
    (["--init_from=gpt2", "--proj_init=zero"],
     "proj_init='zero' with init_from='gpt2': the projections are the weights'"),
    (["--cautious_weight_decay=True", "--weight_decay=0"],
     "cautious_weight_decay=True with weight_decay=0 and muon_weight_decay=0: there is no "
     "weight decay to make cautious."),
    (["--ema_decay=0.99"], "ema_decay=0.99 is a setting of the weights' average, and this run "
                           "has none (ema_tail=0): set ema_tail"),
], ids=["modern GPT-2 weights", "modern with biases", "empty muon_params",
        "muon without a schedule", "rope_theta with gpt2", "muon's keys with adamw",
        "rope_theta overflows float32", "rope_theta vanishes in float32",
        "zero projections of GPT-2's weights", "cautious without decay", "ema_decay alone"])
def test_combinations_that_cannot_work(args, message, env, corpus, tmp_path):
    p = fails("train.py", f"--data_dir={corpus}", f"--out_dir={tmp_path}", *TINY, *args, env=env)
    assert message in p.stderr.strip().splitlines()[-1], p.stderr


@pytest.mark.slow
def test_a_resume_keeps_its_optimizer_and_its_arch(modern_run, env, corpus, tmp_path):
    """An AdamW run of GPT-2's block trained here, and a copy of modern_run (Muon, the modern
    block, at iter 4)."""
    adamw, muon = tmp_path / "adamw", tmp_path / "muon"
    run = [f"--data_dir={corpus}", *TINY, "--gradient_accumulation_steps=1", "--max_iters=1",
           "--eval_interval=1"]
    python("train.py", *run, f"--out_dir={adamw}", env=env)
    shutil.copytree(modern_run, muon)
    resume = [*run[:-2], "--max_iters=5", "--init_from=resume"]
    p = fails("train.py", *resume, f"--out_dir={adamw}", "--optimizer=muon", env=env)
    assert "optimizer='muon' ('adamw' there): the checkpoint in" in p.stderr
    assert "Resume with --optimizer=adamw" in p.stderr
    p = fails("train.py", *resume, f"--out_dir={muon}", env=env)  # the default: adamw
    assert "optimizer='adamw' ('muon' there)" in p.stderr and "Resume with --optimizer=muon " \
           "--muon_params='transformer.h.*.c_*.weight'" in p.stderr
    p = fails("train.py", *resume, f"--out_dir={adamw}", "--arch=modern", env=env)
    assert "arch='modern' ('gpt2' there): the architecture comes from the checkpoint" in p.stderr
    # the arch comes from the checkpoint when it is not given, as the other architecture keys
    p = python("train.py", *resume, "--optimizer=muon", f"--out_dir={muon}", env=env)
    assert "arch = 'modern'" in p.stdout and sorted(steps(muon)) == [0, 1, 2, 3, 4]


def test_a_qwen3_that_the_modern_block_does_not_compute_is_refused(gpt2_data, tmp_path, env):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    folder = tmp_path / "gqa"
    Qwen3ForCausalLM(Qwen3Config(
        vocab_size=50257, hidden_size=32, intermediate_size=swiglu_hidden(32),
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=64)).save_pretrained(folder)
    p = fails("train.py", f"--init_from={folder}", f"--data_dir={gpt2_data}",
              f"--out_dir={tmp_path / 'out'}", "--device=cpu", env=env)
    assert "the Qwen3 has num_key_value_heads=1 in its config.json, a variant that model.py's " \
           "modern block does not compute" in p.stderr.strip().splitlines()[-1]
