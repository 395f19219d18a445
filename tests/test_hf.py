"""GPT-2 weights in and out: hf.py's mapping, train.py and sample.py with init_from=<a GPT-2>,
export.py, and nanoGPT's checkpoints. The GPT-2s are small random ones made here: no test
needs the network."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tiktoken
import torch

# read when transformers is imported: never the network. transformers is imported in the tests
# that use it, not here: each pytest-xdist worker imports every test file to collect it, and
# transformers' GPT-2 costs ~7 CPU s, for the worker that runs this file only
os.environ["HF_HUB_OFFLINE"] = "1"

from ddpgpt import checkpoint, configurator, hf, optim, tokenfile
from ddpgpt.tokenizer import get_tokenizer
from ddpgpt.weights import for_training
from ddpgpt.settings import TrainConfig
from conftest import ROOT, evals, fails, last_json, python, run, stdlib_data, steps, train_args
from ddpgpt.model import GPT, GPTConfig

SMALL = dict(n_layer=2, n_head=2, n_embd=32, n_positions=64)
# train.py on SMALL: short steps on CPU
RUN = ["--block_size=32", "--batch_size=4", "--gradient_accumulation_steps=1", "--eval_iters=2",
       "--device=cpu"]


def random_gpt2(folder, vocab_size=50257):
    """A random GPT2LMHeadModel saved in folder. Every parameter is perturbed: HF starts
    LayerNorms at 1 and biases at 0, which would hide a mix-up of them."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, **SMALL))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return str(folder)


def current_umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def ours(args, weights):
    model = GPT(GPTConfig(**args))
    model.load_state_dict(weights)
    return model.eval()


def max_logit_difference(model, hf_model, ids):
    """Over all positions and the token ids both have (ours may be padded)."""
    with torch.no_grad():
        a, b = model(ids, ids)[0], hf_model(ids).logits
    return (a[..., :b.size(-1)] - b).abs().max().item()


def random_ids(t, vocab_size=50257):
    return torch.randint(0, vocab_size, (2, t), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def gpt2_data(tmp_path_factory, session_env):
    """A few standard-library modules in GPT-2's tokens."""
    return stdlib_data(tmp_path_factory.mktemp("gpt2_data"), ("argparse", "shutil", "textwrap"),
                       "gpt2", session_env)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return random_gpt2(tmp_path_factory.mktemp("hf") / "small-gpt2")


def test_gpt2_124m_maps_both_ways_exactly():
    from transformers import GPT2Config, GPT2LMHeadModel
    theirs = GPT2LMHeadModel(GPT2Config())
    args = hf.model_args_of(theirs.config)
    assert args == dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257,
                        bias=True, gelu_approximate="tanh")
    with torch.device("meta"):  # their weights are assigned: 124M not initialised twice
        model = GPT(GPTConfig(**args))
    # strict: every key, shape
    model.load_state_dict(hf.from_hf_state(theirs.state_dict()), assign=True)
    back, expected = hf.to_hf_state(model.state_dict(), 50257), theirs.state_dict()
    assert back.keys() == expected.keys()
    assert all(torch.equal(back[k], expected[k]) for k in expected)


def test_a_folder_loads_with_transformers_logits(hf_folder, gpt2_data, tmp_path):
    from transformers import GPT2LMHeadModel
    theirs = GPT2LMHeadModel.from_pretrained(hf_folder).eval()
    ids = random_ids(64)
    weights, args = hf.load(hf_folder)
    assert max_logit_difference(ours(args, weights), theirs, ids) < 1e-4
    # train.py's own start-up, with a smaller block_size that crops the position table
    cfg, given = configurator.parse_given(TrainConfig, [
        f"--init_from={hf_folder}", f"--data_dir={gpt2_data}", f"--out_dir={tmp_path}", *RUN],
        "train.py")
    start = for_training(cfg, given, tokenfile.read_meta(gpt2_data))
    args = start.args
    assert (args["n_layer"], args["n_embd"], args["block_size"], args["bias"]) == (2, 32, 32, True)
    model = ours(args, start.weights)
    assert model.transformer.wpe.weight.shape == (32, 32)
    assert max_logit_difference(model.eval(), theirs, ids[:, :32].contiguous()) < 1e-4


@pytest.mark.slow
def test_fine_tune_export_and_reload_in_transformers(hf_folder, gpt2_data, tmp_path, env,
                                                     tiktoken_cache, monkeypatch):
    from transformers import AutoTokenizer, GPT2LMHeadModel
    out, dest = tmp_path / "out", tmp_path / "exported"
    args = ["config/finetune_gpt2.py", f"--init_from={hf_folder}", f"--data_dir={gpt2_data}",
            f"--out_dir={out}", *RUN, "--eval_interval=2"]
    p = python("train.py", *args, "--max_iters=4", env=env)
    assert f"loaded the GPT-2 weights of {hf_folder}" in p.stdout
    # the same command again, as a restart or a requeue runs it, goes on from the checkpoint
    p = python("train.py", *args, "--max_iters=6", env=env)
    assert "resuming from" in p.stdout and "(iter 4)" in p.stdout
    assert sorted(steps(out)) == [0, 1, 2, 3, 4, 5]
    python("export.py", f"--out_dir={out}", f"--to={dest}", env=env)
    state, _ = checkpoint.load_latest(str(out))
    assert state["iter_num"] == 6 and state["model_args"]["gelu_approximate"] == "tanh"
    theirs = GPT2LMHeadModel.from_pretrained(dest).eval()
    assert theirs.config.activation_function == "gelu_new"
    model = ours(state["model_args"], checkpoint.model_state(state))
    assert max_logit_difference(model, theirs, random_ids(32)) < 1e-4
    assert theirs.generate(random_ids(5)[:1], max_new_tokens=5, do_sample=False).shape == (1, 10)
    with open(dest / "generation_config.json") as f:
        assert json.load(f)["eos_token_id"] == 50256

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", tiktoken_cache)
    enc, tok = tiktoken.get_encoding("r50k_base"), AutoTokenizer.from_pretrained(dest)
    for text in ("Hello, world!  It's 2024.\n\n", "naïve café 日本語 🙂", "a<|endoftext|>b"):
        assert tok.encode(text) == enc.encode(text, allowed_special="all"), text
        assert tok(text, split_special_tokens=True)["input_ids"] == enc.encode_ordinary(text)
    assert "lm_eval --model hf" in (dest / "README.md").read_text()
    assert not os.path.exists(f"{dest}.tmp")


def nanogpt_checkpoint(out_dir):
    """A checkpoint as nanoGPT writes it: ckpt.pt, torch.compile's '_orig_mod.' prefix, the
    causal-mask buffers of its pre-2.0 attention, its keys, a padded vocabulary."""
    args = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, bias=True, vocab_size=50304,
                dropout=0.0)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**args))
    optimizer = optim.make_optimizer(model, 0.1, 1e-3, (0.9, 0.95), "cpu")
    x = random_ids(32)
    model(x, x)[1].backward()
    optimizer.step()
    weights = {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}
    causal_mask = torch.tril(torch.ones(32, 32)).view(1, 1, 32, 32)
    for i in range(2):
        weights[f"_orig_mod.transformer.h.{i}.attn.bias"] = causal_mask
    os.makedirs(out_dir)
    torch.save({"model": weights, "optimizer": optimizer.state_dict(), "model_args": args,
                "iter_num": 2, "best_val_loss": torch.tensor(9.5),
                "config": {"dataset": "openwebtext", "init_from": "scratch", "batch_size": 4}},
               os.path.join(out_dir, "ckpt.pt"))
    return model.eval()


@pytest.mark.slow
def test_a_nanogpt_checkpoint_samples_resumes_and_exports(gpt2_data, tmp_path, env):
    from transformers import GPT2LMHeadModel
    out, dest = tmp_path / "out", tmp_path / "exported"
    model = nanogpt_checkpoint(out)
    p = python("sample.py", f"--out_dir={out}", "--start=Hello", "--num_samples=1",
               "--max_new_tokens=3", env=env)
    assert p.stdout.startswith("Hello") and "tokenizer 'gpt2' from nanoGPT's default" in p.stderr
    p = python("train.py", "--init_from=resume", f"--data_dir={gpt2_data}", f"--out_dir={out}",
               *RUN, "--max_iters=4", "--eval_interval=2", env=env)
    assert f"resuming from {out / 'ckpt.pt'} (iter 2)" in p.stdout and sorted(steps(out)) == [2, 3]
    python("export.py", f"--out_dir={out / 'ckpt.pt'}", f"--to={dest}", env=env)
    theirs = GPT2LMHeadModel.from_pretrained(dest).eval()
    assert theirs.config.vocab_size == 50257 and theirs.config.activation_function == "gelu"
    assert max_logit_difference(model, theirs, random_ids(32)) < 1e-4
    assert "The 47 padding rows belong to no token" in (dest / "README.md").read_text()


@pytest.fixture(scope="module")
def byte_run(corpus, tmp_path_factory, session_env):
    """(out_dir, CompletedProcess) of 1 step of TINY on the byte corpus from scratch, run as
    `python -X importtime train.py`: trained once, for the tests that export it, fine-tune into
    it, and read what it imported. A test that exports or writes copies it first."""
    out = tmp_path_factory.mktemp("byte_run") / "out"
    p = run([sys.executable, "-X", "importtime", os.path.join(ROOT, "train.py"),
             *train_args(corpus, out, "--gradient_accumulation_steps=1", "--max_iters=1",
                         "--eval_interval=1")], session_env)
    return str(out), p


def copy_of(byte_run, out):
    shutil.copytree(byte_run[0], out)
    return out


@pytest.fixture(scope="module")
def byte_exports(byte_run, tmp_path_factory, session_env):
    """Two export.py of a copy of byte_run started at once into one --to, beside a folder of the
    user's named like export's temporary one: (that folder's parent, [(returncode, stdout,
    stderr) of each]). Run once: the winner's --to is the export whose contents a test reads,
    the two ends what the test of the race reads."""
    root = tmp_path_factory.mktemp("byte_exports")
    out, dest = copy_of(byte_run, root / "out"), root / "exported"
    (root / "exported.tmp").mkdir()
    (root / "exported.tmp" / "notes.txt").write_text("mine")
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "export.py"), f"--out_dir={out}",
                               f"--to={dest}"],
                              env=session_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    ends = [(p, *p.communicate(timeout=600)) for p in procs]
    return root, [(p.returncode, stdout, stderr) for p, stdout, stderr in ends]


@pytest.mark.slow
def test_a_byte_model_without_biases_exports_exactly(byte_exports):
    from transformers import AutoTokenizer, GPT2LMHeadModel
    root, ends = byte_exports
    out, dest = root / "out", root / "exported"
    assert 0 in [returncode for returncode, _, _ in ends], ends  # export.py --out_dir=out --to=dest
    state, _ = checkpoint.load_latest(str(out))
    assert state["model_args"]["bias"] is False and state["model_args"]["vocab_size"] == 320
    theirs = GPT2LMHeadModel.from_pretrained(dest).eval()
    assert theirs.config.vocab_size == 257 and theirs.config.eos_token_id == 256
    model = ours(state["model_args"], checkpoint.model_state(state))
    assert max_logit_difference(model, theirs, random_ids(32, vocab_size=257)) < 1e-4
    readme = (dest / "README.md").read_text()
    assert "list(text.encode('utf-8'))" in readme and "The 63 padding rows" in readme
    # the tokenizer: AutoTokenizer encodes a text into its UTF-8 bytes and decodes as ours does
    tok, byte = AutoTokenizer.from_pretrained(dest), get_tokenizer("byte")
    assert (len(tok), tok.eos_token_id, tok.model_max_length) == (257, 256, 32)
    for text in ("def foo(x):\n    return x  # naïve café 日本語 🙂\r\n\t", "", "  "):
        assert tok(text)["input_ids"] == byte.encode(text) == list(text.encode("utf-8"))
        assert tok.decode(byte.encode(text)) == text
    assert tok("a<|endoftext|>b", split_special_tokens=True)["input_ids"] == \
        byte.encode("a<|endoftext|>b")
    rng = np.random.default_rng(0)  # any ids, so split and invalid UTF-8 and end-of-text too
    for _ in range(300):
        ids = rng.integers(0, 257, rng.integers(1, 40)).tolist()
        assert tok.decode(ids, skip_special_tokens=True) == byte.decode(ids), ids
    assert tok.decode([104, 256, 105]) == "h<|endoftext|>i"
    # every file as a plain open() writes it: readable by all, as save_pretrained's siblings
    assert {f: oct(os.stat(dest / f).st_mode & 0o777) for f in os.listdir(dest)} == \
        {f: oct(0o666 & ~current_umask()) for f in os.listdir(dest)}


@pytest.mark.slow
def test_two_exports_into_one_dest_and_a_users_dest_tmp(byte_exports):
    """A folder of the user's named like export's temporary one is left alone (export's own
    carries its pid and host), and the loser of two exports into one --to is told so, not to
    free space."""
    from transformers import GPT2LMHeadModel
    root, ends = byte_exports
    dest = root / "exported"
    assert sorted(returncode for returncode, _, _ in ends) == [0, 1], ends
    loser = [stderr for returncode, _, stderr in ends if returncode == 1][0]
    loser = loser.strip().splitlines()[-1]
    assert loser.startswith((f"export.py: error: {dest} was made by another process while "
                             f"this export wrote it (a second export.py into the same --to?)",
                             f"export.py: error: {dest} exists")), loser
    assert "free space" not in loser and "Traceback" not in ends[0][2] + ends[1][2]
    GPT2LMHeadModel.from_pretrained(dest)  # the winner's, whole
    assert sorted(os.listdir(root)) == ["exported", "exported.tmp", "out"]
    assert (root / "exported.tmp" / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_a_checkpoint_scores_and_samples_as_its_export(byte_exports, corpus, env):
    """The 63 padding rows of the checkpoint's 320 take no probability: eval.py's loss of the
    export is the val loss train.py logged at the checkpoint (TINY's 4 x 4 windows), and
    sample.py's text for one seed is the checkpoint's (the loss was taken over the padding too,
    and samples drawn over 320 ids, not 257). sample.py reads the export with its own
    tokenizer (was: GPT-2's, refused for 257 ids)."""
    root, _ = byte_exports
    out, dest = root / "out", root / "exported"
    p = python("eval.py", f"--init_from={dest}", f"--data_dir={corpus}", "--hellaswag=False",
               "--eval_iters=4", "--batch_size=4", "--device=cpu", env=env)
    trained = evals(out)[-1]
    assert trained["iter"] == 1
    assert last_json(p.stdout)["val_loss"] == pytest.approx(trained["val_loss"], rel=1e-5)
    # top_k=0: the whole distribution, where the padding would take its share
    ps = [python("sample.py", source, "--start=def ", "--num_samples=2", "--seed=3",
                 "--max_new_tokens=40", "--top_k=0", "--device=cpu", env=env)
          for source in (f"--out_dir={out}", f"--init_from={dest}")]
    assert ps[1].stdout.startswith("def ") and ps[1].stdout == ps[0].stdout
    assert f"{dest}, tokenizer 'byte' (its tokenizer.json)" in ps[1].stderr, ps[1].stderr


@pytest.mark.slow
def test_sample_from_a_folder(hf_folder, env):
    p = python("sample.py", f"--init_from={hf_folder}", "--start=Hello", "--num_samples=2",
               "--max_new_tokens=5", env=env)
    samples = p.stdout.split("\n---------------\n")
    assert len(samples) == 3 and all(s.startswith("Hello") for s in samples[:2])


def test_a_run_from_scratch_does_not_import_transformers(byte_run):
    _, p = byte_run
    assert "| torch\n" in p.stderr and "transformers" not in p.stderr


# ---- what a user sees for bad input ----

@pytest.fixture(scope="module")
def bad_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    (root / "llama").mkdir()
    (root / "llama" / "config.json").write_text('{"model_type": "llama"}')
    return {"llama": str(root / "llama"), "bytes": random_gpt2(root / "bytes", vocab_size=257)}


@pytest.mark.parametrize("init_from, args, message", [
    ("llama", [], "holds a 'llama' model (config.json's model_type), not a GPT-2"),
    ("bytes", [], "('gpt2' tokens) has 50257 token ids, more than the 257 that the model embeds"),
    ("small", ["--n_layer=3"], "n_layer=3 (2 there): the architecture comes from the weights of"),
    ("small", ["--block_size=128"], "block_size=128 is more than the 64 positions of the weights"),
    ("gtp2", [], "init_from='gtp2' is none of scratch, resume, auto, GPT-2's weights by name"),
], ids=["not a GPT-2", "vocabulary too small", "conflicting n_layer", "block_size too large",
        "misspelt name"])
@pytest.mark.slow
def test_bad_weights(init_from, args, message, bad_folders, hf_folder, gpt2_data, tmp_path, env):
    init_from = {**bad_folders, "small": hf_folder}.get(init_from, init_from)
    p = fails("train.py", f"--init_from={init_from}", f"--data_dir={gpt2_data}",
              f"--out_dir={tmp_path}", "--device=cpu", *args, env=env)
    assert message in p.stderr.strip().splitlines()[-1], p.stderr


@pytest.mark.slow
def test_weights_of_fewer_ids_than_gpt2s_are_not_sampled_with_gpt2s_tokens(bad_folders, env):
    """A folder with no tokenizer.json is read with GPT-2's tokenizer, whose ids must fit."""
    folder = bad_folders["bytes"]
    p = fails("sample.py", f"--init_from={folder}", "--num_samples=1", env=env)
    assert p.stderr.strip().splitlines()[-1] == (
        f"sample.py: error: GPT-2's tokenizer, with which Hugging Face weights without one are "
        f"read, has 50257 token ids, more than the 257 that {folder} embeds: use the checkpoint "
        f"they were exported from, with --out_dir.")


@pytest.mark.slow
def test_a_gpt2_folder_is_not_fine_tuned_on_other_tokens(hf_folder, corpus, tmp_path, env):
    """By name (gpt2) this was refused; a folder of GPT-2's 50257 ids fine-tuned on byte ids,
    each read as another GPT-2 token."""
    p = fails("train.py", f"--init_from={hf_folder}", f"--data_dir={corpus}",
              f"--out_dir={tmp_path}", *RUN, env=env)
    assert p.stderr.strip().splitlines()[-1] == (
        f"train.py: error: {corpus} holds 'byte' tokens (257 ids), which the weights of "
        f"{hf_folder} (50257 token ids, GPT-2's) cannot read: prepare the data with the "
        f"tokenizer those weights were trained with (--tokenizer=gpt2 for OpenAI's GPT-2).")


@pytest.mark.slow
def test_a_fine_tune_into_another_runs_out_dir_says_to_use_a_new_one(hf_folder, gpt2_data,
                                                                     byte_run, tmp_path, env):
    """It resumed the byte run's checkpoint there and failed on its vocab_size."""
    out = copy_of(byte_run, tmp_path / "out")
    p = fails("train.py", f"--init_from={hf_folder}", f"--data_dir={gpt2_data}",
              f"--out_dir={out}", *RUN, env=env)
    assert p.stderr.strip().splitlines()[-1] == (
        f"train.py: error: {out} holds a checkpoint of another model (iter 1: n_layer=2, "
        f"n_head=2, n_embd=32, vocab_size=320, trained on 'byte' tokens), not a fine-tune of "
        f"{hf_folder} (n_layer=2, n_head=2, n_embd=32, vocab_size=50257): init_from="
        f"{hf_folder} resumes the checkpoints in its out_dir, so that a restarted fine-tune "
        f"goes on. Give this fine-tune a new out_dir, or use --init_from=resume to go on with "
        f"that run.")


@pytest.mark.parametrize("script", ["train.py", "sample.py"])
def test_gpt2_offline_without_cached_weights(script, gpt2_data, tmp_path, env):
    env.update(HF_HOME=str(tmp_path / "empty_hf_home"), HF_HUB_OFFLINE="1")
    args = [f"--data_dir={gpt2_data}", f"--out_dir={tmp_path}"] if script == "train.py" else []
    p = fails(script, "--init_from=gpt2", *args, env=env)
    message = p.stderr.strip().splitlines()[-1]
    assert message.startswith(f"{script}: error: GPT-2's weights 'gpt2' (openai-community/gpt2) "
                              f"are not in Hugging Face's cache"), p.stderr
    assert "hf download openai-community/gpt2" in message and "--init_from=./gpt2" in message


def test_without_hf_hub_offline_the_fix_is_said_before_the_hubs_retries(tmp_path, env):
    """No network (a closed port as the hub) and HF_HUB_OFFLINE unset: the hub is retried for
    about 30 s before the error; the line saying how to skip that comes first."""
    del env["HF_HUB_OFFLINE"]
    env.update(HF_HOME=str(tmp_path / "empty_hf_home"), HF_ENDPOINT="http://127.0.0.1:9")
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "sample.py"), "--init_from=gpt2",
                          "--device=cpu"], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    try:
        first = p.stderr.readline()  # sample.py's own lines go to stderr
    finally:
        p.kill()
        p.wait()
    assert first.startswith("loading openai-community/gpt2 through Hugging Face's hub and its "
                            "cache; without network, set HF_HUB_OFFLINE=1"), first


@pytest.mark.slow
def test_export_errors(tmp_path, env):
    (tmp_path / "dest").mkdir()
    p = fails("export.py", f"--out_dir={tmp_path}", f"--to={tmp_path / 'dest'}", env=env)
    assert f"export.py: error: {tmp_path / 'dest'} exists" in p.stderr
    p = fails("export.py", f"--out_dir={tmp_path}", f"--to={tmp_path / 'new'}", env=env)
    assert f"export.py: error: {tmp_path} holds no loadable checkpoint" in p.stderr
    assert not os.path.exists(tmp_path / "new")
