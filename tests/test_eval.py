"""eval.py, hellaswag.py and bits per byte, as a user runs them: HellaSwag's counts against a
plain computation (one example at a time, the model called per ending), on 1 and 2 ranks; bits
per byte against the loss (byte tokens) and against the bytes of the scored text (GPT-2
tokens); HellaSwag and val_bpb in train.py's metrics; and clear errors for bad input."""
import json
import math
import os
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ddpgpt import checkpoint, data, hellaswag, tokenfile
from ddpgpt.errors import UserError
from conftest import (TINY, evals, fails, last_json, python, torchrun, train_args,
                      write_token_files)
from ddpgpt.model import GPT, GPTConfig

# a dozen examples: short and long contexts and endings, non-ASCII text, a label given as a
# digit string (as the Hugging Face copy has it); no two endings alike
EXAMPLES = [
    ("A man is sitting on a roof. He",
     ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
      "is holding a rubik's cube.", "starts pulling up roofing on a roof."], 3),
    ("def greet(name):",
     ["return 'hello ' + name", "import os", "pass  # nothing", "while True: break"], 0),
    ("Le café était fermé, alors elle",
     ["est rentrée chez elle.", "a mangé un nuage.", "a bu le café de toute façon.",
      "est partie à Zürich à pied."], 0),
    ("Un naïve chef in Tōkyō (東京) writes 日本語 on the menu and",
     ["smiles 🙂.", "the menu flies away like a bird over the sea of Japan.", "x",
      "asks for a ¥ price."], 1),
    ("How to make tea. Boil water in a kettle. Put a tea bag in a cup. Pour the water over "
     "the bag and wait three to five minutes. Then",
     ["remove the bag and add milk or lemon if you like.", "eat the kettle.",
      "paint the cup blue and wait for the tea to be ready tomorrow.", "run."], 0),
    ("x = 1\ny = 2\nprint(x +",
     ["y)", "z)", " the quick brown fox jumps over the lazy dog and many other things)",
      "1)"], 0),
    ("The orchestra tuned their instruments while the audience",
     ["took their seats and the lights dimmed slowly across the whole hall.",
      "ate the violins.", "became an orchestra.", "was a triangle."], 0),
    ("Ünïcödé everywhere: ñ, ø, ß, €, ©, and then the writer",
     ["stopped.", "wrote more ü and ö and ä until the page was full of them.",
      "∑∫√ and so on", "forgot the rest"], 1),
    ("A very long context about gardening. " * 6 + "Finally the gardener",
     ["waters the plants.", "plants the waters.", "digs a hole in the sky.",
      "sells the garden to a cloud that passes by every afternoon at three."], 0),
    ("Short:", ["a", "bb", "ccc", "dddd"], "2"),
    ("Cats are", ["animals.", "vegetables in disguise, as everyone who owns one knows.",
                  "minerals.", "numbers."], 0),
    ("She opened the door and saw",
     ["her friend smiling on the porch, holding a cake with candles.",
      "nothing at all.", "a door.", "the ocean inside the hallway, waves and all."], 0),
]


def write_hellaswag(path, examples=EXAMPLES):
    with open(path, "w", encoding="utf-8") as f:
        for ctx, endings, label in examples:
            f.write(json.dumps({"ctx": ctx, "endings": endings, "label": label},
                               ensure_ascii=False) + "\n")
    return str(path)


def reference_hellaswag(logits_of, encode, block_size):
    """(right by summed loss, right by mean loss, examples cut, the smallest gap between the best
    ending and the next): one example at a time, one call per ending, plain loops."""
    right = right_norm = cut = 0
    gap = math.inf
    for ctx, endings, label in EXAMPLES:
        context, sums, means = encode(ctx), [], []
        cut += any(len(context) + len(encode(" " + e)) > block_size + 1 for e in endings)
        for ending in endings:
            tokens = encode(" " + ending)
            row = (context + tokens)[-(block_size + 1):]
            logp = F.log_softmax(logits_of(row[:-1]).float(), dim=-1)
            scored = range(len(row) - 1 - min(len(tokens), len(row) - 1), len(row) - 1)
            losses = [-logp[t, row[t + 1]].item() for t in scored]
            sums.append(sum(losses))
            means.append(sum(losses) / len(losses))
        right += sums.index(min(sums)) == int(label)
        right_norm += means.index(min(means)) == int(label)
        gap = min(gap, *(sorted(v)[1] - sorted(v)[0] for v in (sums, means)))
    return right, right_norm, cut, gap


def check_counts(result, reference):
    right, right_norm, cut, gap = reference
    assert gap > 1e-4  # no near-tie that float rounding could turn either way
    n = len(EXAMPLES)
    assert (result["hellaswag_n"], result["hellaswag_truncated"]) == (n, cut)
    assert (result["hellaswag_acc"], result["hellaswag_acc_norm"]) == (right / n, right_norm / n)


@pytest.fixture(scope="module")
def swag_file(tmp_path_factory):
    return write_hellaswag(tmp_path_factory.mktemp("hellaswag") / "hellaswag_val.jsonl")


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory, session_env, corpus, swag_file):
    """A byte-level model trained with HellaSwag at iters 0 and 20, evaluations every 10."""
    out = tmp_path_factory.mktemp("byte_run") / "out"
    python("train.py", f"--data_dir={corpus}", f"--out_dir={out}", *TINY, "--block_size=64",
           "--gradient_accumulation_steps=1", "--max_iters=20", "--eval_interval=10",
           "--hellaswag_interval=20", f"--hellaswag_path={swag_file}", env=session_env)
    return str(out)


def test_training_records_hellaswag_and_bits_per_byte(byte_run):
    rows = evals(byte_run)
    assert [r["iter"] for r in rows] == [0, 10, 20]
    assert [r["iter"] for r in rows if "hellaswag_acc_norm" in r] == [0, 20]
    for r in rows:
        assert r["val_bpb"] == pytest.approx(r["val_loss"] / math.log(2), rel=1e-12)
        if "hellaswag_n" in r:
            assert r["hellaswag_n"] == len(EXAMPLES) and 0 <= r["hellaswag_acc_norm"] <= 1


@pytest.mark.slow
def test_hellaswag_counts_match_a_plain_computation_on_1_and_2_ranks(byte_run, swag_file, env,
                                                                      corpus, cached_eval):
    """1 rank: cached_eval (the checkpoint's data and 4 x 4 val windows); 2 ranks: the same data
    and 16 windows in batches of 2, HellaSwag from its path."""
    one = last_json(cached_eval.stdout)
    two = last_json(torchrun(2, "eval.py", f"--out_dir={byte_run}", f"--hellaswag_path={swag_file}",
                             "--device=cpu", "--batch_size=2", f"--data_dir={corpus}",
                             "--eval_iters=8", env=env).stdout)
    state, _ = checkpoint.load_latest(byte_run)
    model = GPT(GPTConfig(**state["model_args"]), state["data_meta"]["vocab_size"]).eval()
    model.load_state_dict(checkpoint.model_state(state))

    def logits_of(ids):
        x = torch.tensor([ids])
        return model(x, x)[0][0].detach()

    reference = reference_hellaswag(logits_of, lambda text: list(text.encode("utf-8")), 64)
    assert 0 < reference[2] < len(EXAMPLES)  # some examples are cut to block_size, some not
    check_counts(one, reference)
    assert {k: v for k, v in one.items() if k.startswith("hellaswag_") and k != "hellaswag_s"} \
        == {k: v for k, v in two.items() if k.startswith("hellaswag_") and k != "hellaswag_s"}
    # every byte token is a byte: bits per byte are the loss in bits
    assert one["val_bpb"] == pytest.approx(one["val_loss"] / math.log(2), rel=1e-12)
    assert two["val_loss"] == pytest.approx(one["val_loss"], rel=1e-6)


def offline(env, cache):
    """env with DDPGPT_CACHE=cache, behind a proxy that refuses every connection: offline, at
    once."""
    env.update(DDPGPT_CACHE=str(cache), HTTPS_PROXY="http://127.0.0.1:9",
               https_proxy="http://127.0.0.1:9", NO_PROXY="", no_proxy="")
    return env


@pytest.fixture(scope="module")
def cached_eval(byte_run, swag_file, session_env, tmp_path_factory):
    """eval.py of byte_run given nothing but the device, offline, with HellaSwag's file in the
    cache as docs/evaluation.md says to put it."""
    cache = tmp_path_factory.mktemp("cache")
    shutil.copy(swag_file, cache / "hellaswag_val.jsonl")
    return python("eval.py", f"--out_dir={byte_run}", "--device=cpu",
                  env=offline(dict(session_env), cache))


def test_eval_gives_what_training_recorded_at_the_same_checkpoint(byte_run, cached_eval):
    # no data_dir, eval_iters, batch_size or block_size: the checkpoint's (TINY's), so the same
    # windows and HellaSwag batches as train.py's evaluation at iter 20
    p = cached_eval
    result, trained = last_json(p.stdout), evals(byte_run)[-1]
    for key in ("val_loss", "val_bpb", "hellaswag_acc", "hellaswag_acc_norm"):
        assert result[key] == pytest.approx(trained[key], rel=1e-9), key
    assert "HellaSwag: acc_norm " in p.stdout and "ckpt_0000020.pt (iter 20)" in p.stdout
    assert ", the checkpoint's data_dir, 4 x 4 windows of 64 tokens" in p.stderr, p.stderr


@pytest.fixture(scope="module")
def copy_run(tmp_path_factory, session_env, corpus):
    """(data_dir, out_dir) of a run of 2 steps on data_dir, a copy of the corpus: what
    prepare.py makes of its documents with --val_docs=1. Each test that takes it first puts
    data_dir in the state it needs (gone, or prepared again), so their order does not
    matter."""
    root = tmp_path_factory.mktemp("copy_run")
    data_dir, out = root / "data", root / "out"
    shutil.copytree(corpus, data_dir)
    python("train.py", *train_args(data_dir, out, "--gradient_accumulation_steps=1",
                                   "--max_iters=2", "--eval_interval=2"), env=session_env)
    return data_dir, out


@pytest.mark.slow
def test_eval_of_a_checkpoint_whose_data_is_gone_says_what_to_give(corpus, swag_file, copy_run,
                                                                   env):
    data_dir, out = copy_run
    shutil.rmtree(data_dir, ignore_errors=True)
    message = fails("eval.py", f"--out_dir={out}", env=env).stderr.strip().splitlines()[-1]
    assert message.startswith(f"eval.py: error: the checkpoint trained on {data_dir}, which "
                              f"cannot be read here: {data_dir}/"), message
    assert message.endswith("Give --data_dir=<the same data's folder here>, or "
                            "--val_loss=False for HellaSwag alone."), message
    p = python("eval.py", f"--out_dir={out}", "--val_loss=False", f"--hellaswag_path={swag_file}",
               "--device=cpu", env=env)
    assert "val_loss" not in last_json(p.stdout) and "hellaswag_n" in last_json(p.stdout)
    p = python("eval.py", f"--out_dir={out}", f"--data_dir={corpus}", "--hellaswag=False",
               "--device=cpu", env=env)
    assert last_json(p.stdout)["val_loss"] == pytest.approx(evals(out)[-1]["val_loss"], rel=1e-9)


@pytest.mark.slow
def test_a_mixture_reports_bits_per_byte_per_source(corpus, tmp_path, env):
    other = str(tmp_path / "other")
    write_token_files(other, dict.fromkeys(tokenfile.SPLITS, np.random.default_rng(0).integers(
        0, 256, 20_000)), tokenizer="byte", vocab_size=257, eot_token=256)
    out = tmp_path / "out"
    python("train.py", f"--data_mix={corpus}=0.7,{other}=0.3", f"--out_dir={out}", *TINY,
           "--gradient_accumulation_steps=1", "--max_iters=2", "--eval_interval=2", env=env)
    row = evals(out)[-1]
    names = (os.path.basename(corpus), "other")
    for name in names:
        assert row[f"val_bpb/{name}"] == pytest.approx(row[f"val_loss/{name}"] / math.log(2))
    assert row["val_bpb"] == pytest.approx(
        0.7 * row[f"val_bpb/{os.path.basename(corpus)}"] + 0.3 * row["val_bpb/other"])
    # eval.py evaluates the checkpoint on its mixture, as train.py did
    result = last_json(python("eval.py", f"--out_dir={out}", "--hellaswag=False",
                              "--device=cpu", env=env).stdout)
    for key in ("val_loss", "val_bpb", *(f"val_loss/{n}" for n in names)):
        assert result[key] == pytest.approx(row[key], rel=1e-9), key


@pytest.mark.slow
def test_eval_of_a_checkpoint_whose_data_was_prepared_again_is_refused(corpus, copy_run, env):
    """The checkpoint's data_dir made again from the same documents with another val split
    (val documents the run trained on): refused, naming both; an explicit --data_dir still
    evaluates on the folder as it is (was: evaluated without a word)."""
    data_dir, out = copy_run  # data_dir: the corpus's documents as prepare.py made them
    docs = os.path.join(os.path.dirname(corpus), "docs")
    shutil.rmtree(data_dir, ignore_errors=True)
    python("prepare.py", f"--dataset={docs}", "--tokenizer=byte", "--val_docs=1",
           f"--out_dir={data_dir}", "--num_proc=1", "--seed=7", env=env)
    message = fails("eval.py", f"--out_dir={out}", "--hellaswag=False",
                    env=env).stderr.strip().splitlines()[-1]
    assert message.startswith(f"eval.py: error: {data_dir} is not the data the checkpoint was "
                              f"trained on: its val split is "), message
    assert "so it was prepared again since and this val loss would not be the run's" in message
    p = python("eval.py", f"--out_dir={out}", f"--data_dir={data_dir}", "--hellaswag=False",
               env=env)
    assert "val_loss" in last_json(p.stdout)


@pytest.mark.slow
def test_without_the_data_tokenizer_bits_per_byte_are_left_out_and_hellaswag_refused(tmp_path, env):
    folder, out = str(tmp_path / "data"), f"--out_dir={tmp_path / 'out'}"
    write_token_files(folder, dict.fromkeys(tokenfile.SPLITS, np.random.default_rng(0).integers(
        0, 300, 5_000)), tokenizer="test", vocab_size=300, eot_token=299)
    args = [f"--data_dir={folder}", *TINY, "--gradient_accumulation_steps=1", "--max_iters=0"]
    p = python("train.py", *args, out, env=env)
    assert "note: the evaluations leave bits per byte out: unknown tokenizer 'test'" in p.stdout
    (row,) = evals(tmp_path / "out")
    assert "val_loss" in row and "val_bpb" not in row
    p = fails("train.py", *args, out, "--hellaswag_interval=1", env=env)
    assert "hellaswag_interval=1 needs the data's tokenizer: unknown tokenizer 'test'" in p.stderr


# ---- GPT-2's tokens: a Hugging Face folder, and bits per byte of text with multi-byte characters

@pytest.fixture(scope="module")
def gpt2_setup(tmp_path_factory, session_env):
    """(a random GPT-2 folder of 128 positions, a data folder in GPT-2's tokens)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=128))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(root / "gpt2-small")
    (root / "docs").mkdir()
    text = "".join(f"Paragraph {i}: naïve café, 東京 and 🙂 cost €{i}.\n"
                   for i in range(40))
    for d in range(4):
        (root / "docs" / f"doc{d}.txt").write_text(f"Document {d}.\n{text}", encoding="utf-8")
    python("prepare.py", f"--dataset={root / 'docs'}", "--tokenizer=gpt2", "--val_docs=1",
           f"--out_dir={root / 'data'}", "--num_proc=1", env=session_env)
    return str(root / "gpt2-small"), str(root / "data")


@pytest.mark.slow
def test_gpt2_folder_hellaswag_and_bits_per_byte_of_the_scored_text(gpt2_setup, swag_file, env,
                                                                     tiktoken_cache, monkeypatch):
    import tiktoken
    from transformers import GPT2LMHeadModel

    folder, data_dir = gpt2_setup
    p = python("eval.py", f"--init_from={folder}", f"--data_dir={data_dir}", "--eval_iters=3",
               "--batch_size=2", f"--hellaswag_path={swag_file}", "--device=cpu", env=env)
    result = last_json(p.stdout)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", tiktoken_cache)
    enc = tiktoken.get_encoding("r50k_base")
    theirs = GPT2LMHeadModel.from_pretrained(folder).eval()

    def logits_of(ids):
        with torch.no_grad():
            return theirs(torch.tensor([ids])).logits[0]

    check_counts(result, reference_hellaswag(logits_of, enc.encode, 128))
    message = fails("eval.py", f"--init_from={folder}", "--hellaswag=False", env=env).stderr
    assert f"there is nothing to evaluate: hellaswag=False, and {folder} comes with no data" \
        in message
    # bits per byte: the summed loss in bits over the UTF-8 bytes of the scored text, each
    # end-of-text one byte, window by window over train.py's evaluation windows
    tokens = np.fromfile(os.path.join(data_dir, "val.bin"), dtype=np.uint16).astype(np.int64)
    nats = n_bytes = 0
    for o in data.eval_offsets([0, len(tokens)], 128, 3 * 2):
        x, y = tokens[o:o + 128], tokens[o + 1:o + 129]
        nats += F.cross_entropy(logits_of(x.tolist()), torch.from_numpy(y), reduction="sum")
        n_bytes += len(enc.decode_bytes([t for t in y if t != enc.eot_token]))
        n_bytes += int(np.sum(y == enc.eot_token))
    assert n_bytes > 128 * 6 * 1.5  # many characters of more than one byte, few tokens a byte
    assert result["val_bpb"] == pytest.approx(nats.item() / math.log(2) / n_bytes, rel=1e-4)
    # the same to rounding with eval.py's own summed loss: the bytes are counted exactly
    assert result["val_bpb"] == pytest.approx(
        result["val_loss"] * 6 * 128 / math.log(2) / n_bytes, rel=1e-12)


# ---- what a user sees for bad input ----

GOOD = {"ctx": "A cat", "endings": ["sat.", "ran.", "slept.", "ate."], "label": 0}


@pytest.mark.parametrize("line, words", [
    ('{"ctx": "A cat", "endings": [', ["line 2 is not JSON"]),
    (json.dumps({**GOOD, "endings": ["sat.", "ran.", "slept."]}),
     ["line 2: the endings", "are not a list of 4 texts"]),
    (json.dumps({**GOOD, "label": 4}), ["line 2: the label 4 is not one of 0 to 3"]),
    (json.dumps({"endings": GOOD["endings"], "label": 0}), ["line 2: no 'ctx'"]),
], ids=["not JSON", "three endings", "label out of range", "no ctx"])
def test_bad_hellaswag_lines(line, words, byte_run, tmp_path, env):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + line + "\n")
    p = fails("eval.py", f"--out_dir={byte_run}", f"--hellaswag_path={path}", env=env)
    message = p.stderr.strip().splitlines()[-1]
    assert message.startswith(f"eval.py: error: {path}, line 2"), p.stderr
    assert all(w in message for w in words) and "hellaswag_val.jsonl serves it" in message


@pytest.mark.slow
def test_a_missing_file_and_nothing_to_evaluate(byte_run, tmp_path, env):
    p = fails("eval.py", f"--out_dir={byte_run}", f"--hellaswag_path={tmp_path}/nope.jsonl",
              env=env)
    assert f"hellaswag_path='{tmp_path}/nope.jsonl' is not a file" in p.stderr
    p = fails("eval.py", f"--out_dir={byte_run}", "--hellaswag=False", "--val_loss=False", env=env)
    assert "hellaswag=False and val_loss=False leave nothing to evaluate" in p.stderr
    # an out_dir without a checkpoint: test_a_start_up_error_on_two_ranks_is_reported_once


@pytest.mark.slow
def test_a_start_up_error_on_two_ranks_is_reported_once(tmp_path, env):
    """It was printed by every rank, where train.py reports it once."""
    p = fails("eval.py", f"--out_dir={tmp_path}", nproc=2, env=env)
    assert p.stderr.count("holds no loadable checkpoint") == 1, p.stderr
    assert f"eval.py: error (ranks 0, 1): {tmp_path} holds no loadable checkpoint" in p.stderr


def test_fetched_once_into_the_cache_whole_or_not_at_all(swag_file, tmp_path, monkeypatch):
    monkeypatch.setenv("DDPGPT_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**GOOD, "label": 9}) + "\n")
    monkeypatch.setattr(hellaswag, "URL", bad.as_uri())  # what urllib fetches, with no network
    with pytest.raises(UserError, match="the label 9 is not one of 0 to 3"):
        hellaswag.locate("")
    assert not [f for f in os.listdir(tmp_path / "cache") if f.endswith((".jsonl", ".tmp"))]
    monkeypatch.setattr(hellaswag, "URL", f"file://{swag_file}")
    cached = hellaswag.locate("")
    assert cached == str(tmp_path / "cache" / "hellaswag_val.jsonl")
    assert open(cached, "rb").read() == open(swag_file, "rb").read()
    monkeypatch.setattr(hellaswag, "URL", "file:///no/such/file")  # the copy is read from now on
    assert hellaswag.locate("") == cached


@pytest.mark.slow
def test_offline_without_the_file_hellaswag_is_skipped_or_says_how_to_get_it(byte_run, cached_eval,
                                                                             tmp_path, env):
    offline(env, tmp_path / "cache")
    # not asked for: skipped with one line, and the val loss evaluated
    p = python("eval.py", f"--out_dir={byte_run}", "--device=cpu", env=env)
    (line,) = [line for line in p.stderr.splitlines() if "HellaSwag" in line]
    assert line.startswith("eval.py: HellaSwag skipped: HellaSwag's validation set is not in ")
    assert line.endswith("--hellaswag=False leaves it out without this line."), line
    assert "val_loss" in last_json(p.stdout) and "hellaswag_n" not in last_json(p.stdout)
    # asked for, or nothing else to evaluate: the error that says how to get the file
    for args in (["--hellaswag=True"], ["--val_loss=False"]):
        p = fails("eval.py", f"--out_dir={byte_run}", *args, env=env)
        message = p.stderr.strip().splitlines()[-1]
        assert message.startswith(f"eval.py: error: HellaSwag's validation set is not in "
                                  f"{tmp_path / 'cache'} and could not be downloaded from "
                                  f"https://raw.githubusercontent.com/rowanz/hellaswag/master/"
                                  f"data/hellaswag_val.jsonl"), p.stderr
        assert "curl -L -o hellaswag_val.jsonl" in message and "--hellaswag_path=" in message
    assert not [f for f in os.listdir(tmp_path / "cache") if f.endswith((".jsonl", ".tmp"))]
    # with the file in the cache, as docs/evaluation.md says to put it, the same command works
    # offline: cached_eval, run so
    assert last_json(cached_eval.stdout)["hellaswag_n"] == len(EXAMPLES)


def test_train_stops_before_the_first_step_on_a_bad_file(corpus, tmp_path, env):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({**GOOD, "label": 7}) + "\n")
    p = fails("train.py", f"--data_dir={corpus}", f"--out_dir={tmp_path / 'out'}", *TINY,
              "--hellaswag_interval=10", f"--hellaswag_path={path}", nproc=2, env=env)
    assert p.stderr.count("the label 7 is not one of 0 to 3") == 1 and "(ranks 0, 1)" in p.stderr
