"""sample.py as a user runs it, on tiny models that train.py trains once per module. No test
reads what a model learnt: one step each."""
import os

import pytest
import torch

from conftest import TINY, fails, python

SEP = "---------------"
TRAIN = [*TINY, "--n_layer=1", "--gradient_accumulation_steps=1", "--max_iters=1",
         "--eval_interval=1", "--eval_iters=2"]


def write_corpus(folder):
    """Ten small documents of Python, a .txt file each, for the GPT-2 model."""
    os.makedirs(folder)
    for d in range(10):
        with open(os.path.join(folder, f"doc{d}.txt"), "w") as f:
            f.write("".join(f"def greet_{i}(name):\n    return 'hello ' + name + ' number {i}'\n\n"
                            for i in range(15 * d, 15 * d + 15)))


def variant(src_dir, dst_dir, change):
    """A copy of src_dir's checkpoint with change(state) applied, as the only file of dst_dir."""
    (path,) = [os.path.join(src_dir, f) for f in os.listdir(src_dir) if f.startswith("ckpt_")]
    state = torch.load(path, map_location="cpu", weights_only=True)
    change(state)
    os.makedirs(dst_dir)
    torch.save(state, os.path.join(dst_dir, os.path.basename(path)))
    return dst_dir


@pytest.fixture(scope="module")
def trained(tmp_path_factory, session_env, corpus):
    """out_dirs by name: 'byte' (trained on conftest's corpus, Python source in bytes) and
    'gpt2' models, variants of their checkpoints, and an 'empty' folder."""
    root = tmp_path_factory.mktemp("sample")
    env = session_env
    write_corpus(str(root / "corpus"))
    outs = {"empty": str(root / "empty")}
    os.makedirs(outs["empty"])
    python("prepare.py", f"--dataset={root / 'corpus'}", "--tokenizer=gpt2",
           f"--out_dir={root / 'data_gpt2'}", "--val_docs=2", "--num_proc=1", env=env)
    for name, data_dir in (("byte", corpus), ("gpt2", root / "data_gpt2")):
        outs[name] = str(root / f"out_{name}")
        python("train.py", f"--data_dir={data_dir}", f"--out_dir={outs[name]}", *TRAIN, env=env)

    def tokenizer(name):
        return lambda state: state["data_meta"].update(tokenizer=name)

    def no_data_meta(state):  # as a checkpoint of raw .bin data has
        state["data_meta"] = None

    def padding_wins(state):  # the padded ids (50257..50303) get by far the largest logits:
        w = state["model"]["lm_head.weight"]  # (tied to transformer.wte.weight)
        u = w[50257].clone()  # whatever the hidden state h, h.u or h.(-u) is large and positive
        w[:50257], w[50257::2], w[50258::2] = 0, 1000 * u, -1000 * u

    for name, src, change in (("unknown_tokenizer", "byte", tokenizer("no_such_tokenizer")),
                              ("no_data_meta", "byte", no_data_meta),
                              ("padding_wins", "gpt2", padding_wins)):
        outs[name] = variant(outs[src], str(root / f"out_{name}"), change)
    return outs


def sample(out_dir, *args, env):
    return python("sample.py", f"--out_dir={out_dir}", "--max_new_tokens=40", *args, env=env)


def samples(stdout):
    """The samples printed, each followed by the separator line."""
    parts = stdout.split(f"\n{SEP}\n")
    assert parts[-1] == "", f"output does not end with the separator:\n{stdout}"
    return parts[:-1]


@pytest.fixture(scope="module")
def def_samples(trained, session_env):
    """sample.py --start="def " on the byte model, as a user's shell runs it (no
    OMP_WAIT_POLICY of its own), with OpenMP asked to print the settings it uses: one run whose
    samples, notes and OpenMP settings several tests read."""
    env = dict(session_env, OMP_DISPLAY_ENV="VERBOSE")
    env.pop("OMP_WAIT_POLICY", None)
    return sample(trained["byte"], "--start=def ", "--num_samples=3", env=env)


@pytest.mark.slow
def test_prints_num_samples_each_starting_with_the_prompt(def_samples):
    p = def_samples
    out = samples(p.stdout)
    assert len(out) == 3 and all(s.startswith("def ") and len(s) > len("def ") for s in out)
    assert "tokenizer 'byte' from the checkpoint's data_meta" in p.stderr


@pytest.fixture(scope="module")
def other_seed(trained, session_env):
    """def_samples's command with another seed, and OMP_WAIT_POLICY=ACTIVE chosen, OpenMP asked
    to print the settings it uses: one run that the tests of seeds and of OpenMP read."""
    env = dict(session_env, OMP_DISPLAY_ENV="VERBOSE", OMP_WAIT_POLICY="ACTIVE")
    return sample(trained["byte"], "--start=def ", "--num_samples=3", "--seed=6", env=env)


@pytest.mark.slow
def test_same_seed_same_samples_other_seed_others(trained, def_samples, other_seed, env):
    # def_samples ran with the default seed, 1337: the same again, and other_seed's 6
    again = sample(trained["byte"], "--start=def ", "--num_samples=3", "--seed=1337", env=env)
    assert def_samples.stdout == again.stdout != other_seed.stdout
    assert len(set(samples(def_samples.stdout))) == 3  # the samples of one run differ too


# what OpenMP itself says it uses: its default prints PASSIVE too, but spins 300000 times first
PASSIVE = "GOMP_SPINCOUNT = '0'"


def test_openmp_threads_wait_passively_unless_the_user_chose(def_samples, other_seed):
    """Spinning threads made sample.py's 200 tokens many times slower on a loaded machine.
    def_samples ran without OMP_WAIT_POLICY, other_seed with ACTIVE."""
    assert PASSIVE in def_samples.stderr
    assert "POLICY = 'ACTIVE'" in other_seed.stderr and PASSIVE not in other_seed.stderr


def test_prompt_from_file(trained, env, tmp_path):
    prompt = "naïve prompt\nfrom a file: "
    (tmp_path / "prompt.txt").write_text(prompt, encoding="utf-8")
    p = sample(trained["byte"], f"--start=FILE:{tmp_path / 'prompt.txt'}", "--num_samples=2",
               env=env)
    assert [s[:len(prompt)] for s in samples(p.stdout)] == [prompt, prompt]


def test_gpt2_data_samples_offline(trained, env):
    p = sample(trained["gpt2"], "--start=def greet", "--num_samples=2", env=env)
    assert all(s.startswith("def greet") for s in samples(p.stdout))
    assert "tokenizer 'gpt2'" in p.stderr


@pytest.mark.slow
def test_padded_vocabulary_ids_are_never_sampled(trained, env):
    # without the mask tiktoken fails on the first padded id with a KeyError
    p = sample(trained["padding_wins"], "--start=def", "--top_k=0", env=env)
    assert len(samples(p.stdout)) == 3


def test_without_data_meta_the_data_dirs_meta_json_names_the_tokenizer(trained, env):
    p = sample(trained["no_data_meta"], "--start=def ", env=env)
    assert all(s.startswith("def ") for s in samples(p.stdout))
    assert "tokenizer 'byte' from" in p.stderr and "meta.json" in p.stderr


@pytest.mark.parametrize("out, args, words", [
    ("empty", [], ["holds no loadable checkpoint", "--out_dir"]),
    ("byte", ["--start=FILE:no/such/prompt.txt"], ["no/such/prompt.txt", "No such file"]),
    ("byte", ["--temprature=1"], ["'temprature'", "did you mean temperature"]),
    ("byte", ["--start="], ["prompt", "empty", "--start"]),
    ("byte", ["--temperature=0"], ["temperature=0.0", "--top_k=1"]),
    ("unknown_tokenizer", [], ["unknown tokenizer 'no_such_tokenizer'", "'byte'"]),
], ids=["empty out_dir", "missing prompt file", "misspelt key", "empty prompt",
        "zero temperature", "unknown tokenizer"])
@pytest.mark.slow
def test_errors_are_one_paragraph_without_a_traceback(trained, env, out, args, words):
    p = fails("sample.py", f"--out_dir={trained[out]}", *args, env=env)
    assert p.stdout == ""
    message = p.stderr.strip().splitlines()[-1]
    assert message.startswith("sample.py: error: ")
    assert all(w in message for w in words), message
