"""data_mix: each global sample's source drawn by weight as a pure function of (seed, index),
each source in its own epoch order, the same global batches on any world size, exact resume,
per-source evaluation, and clear errors for bad mixtures."""
import os
import shutil

import numpy as np
import pytest

from ddpgpt import data, tokenfile
from ddpgpt.sources import parse_mix
from conftest import (TINY, batches_and_losses, evals, fails, python,
                      same_on_any_world_size_and_resumed, steps, write_token_files)

WEIGHTS = (0.7, 0.2, 0.1)


def byte_folder(folder, n_train, seed, tokenizer="byte", vocab=257):
    rng = np.random.default_rng(seed)
    write_token_files(str(folder), {"train": rng.integers(0, vocab - 1, n_train),
                                              "val": rng.integers(0, vocab - 1, 5_000)},
                                tokenizer=tokenizer, vocab_size=vocab, eot_token=vocab - 1)
    return str(folder)


@pytest.fixture(scope="module")
def sources(corpus, tmp_path_factory):
    """Three byte-tokenized sources of different sizes: web (the corpus), code, books (no test
    changes them)."""
    root = tmp_path_factory.mktemp("sources")
    return [corpus, byte_folder(root / "code", 40_000, 1), byte_folder(root / "books", 20_000, 2)]


def mix_arg(folders, weights=WEIGHTS):
    return "--data_mix=" + ",".join(f"{f}={w}" for f, w in zip(folders, weights))


def test_each_source_gets_its_share_of_the_samples():
    mix = data.mixture([None] * 3, WEIGHTS, ("a", "b", "c"))
    source, _ = data.source_indices(np.arange(100_000), mix, seed=3)
    for s, w in enumerate(WEIGHTS):  # within 4 standard deviations of a binomial draw
        assert abs(np.mean(source == s) - w) < 4 * np.sqrt(w * (1 - w) / 100_000)
    # and exactly, to a sample, over every MIX_BLOCK samples
    source, _ = data.source_indices(np.arange(data.MIX_BLOCK, 2 * data.MIX_BLOCK), mix, seed=3)
    assert np.bincount(source).tolist() == list(mix.counts)
    assert all(abs(c / data.MIX_BLOCK - w) < 1e-6 for c, w in zip(mix.counts, WEIGHTS))


def test_each_source_reads_every_block_once_per_its_own_epoch():
    sizes = [40_001, 13_001, 7_001]
    splits = tuple(tokenfile.TokenSplit((f"{i}.bin",), np.dtype(np.uint16), 0,
                                        np.array([0, n])) for i, n in enumerate(sizes))
    mix = data.mixture(splits, WEIGHTS, ("a", "b", "c"))
    block = 32
    source, offsets = data.sample_windows(np.arange(2 * data.MIX_BLOCK), mix, block, 9, "epoch")
    for s, n in enumerate(sizes):
        per_epoch = int(data.blocks_per_epoch(n, block))
        mine = offsets[source == s]  # in global sample order: the source's own order
        epochs = len(mine) // per_epoch
        assert epochs >= 3
        local = data.source_indices(np.flatnonzero(source == s), mix, 9)[1]
        assert sorted(local.tolist()) == list(range(len(mine)))
        by_local = mine[np.argsort(local)]
        for e in range(epochs):
            blocks = by_local[e * per_epoch:(e + 1) * per_epoch] // block
            assert len(np.unique(blocks)) == per_epoch, (s, e)


MIX_RUN = [*TINY, "--gradient_accumulation_steps=2", "--eval_interval=3"]


@pytest.fixture(scope="module")
def mixture_run(sources, tmp_path_factory, session_env):
    """The mixture trained 6 steps on 1 rank, on 2, and on 2 stopped at 3 and resumed, checked to
    read the same batches (conftest): the 1-rank run's (out_dir, CompletedProcess), whose
    checkpoint at 6 the test of new weights resumes from a copy of."""
    return same_on_any_world_size_and_resumed([mix_arg(sources), *MIX_RUN],
                                              tmp_path_factory.mktemp("mixture"), session_env)


@pytest.mark.slow
def test_mixture_trains_the_same_batches_on_any_world_size_and_resumes_exactly(
        sources, mixture_run):
    one, p = mixture_run
    assert "data: code (" in p.stdout and "20.00% of the samples" in p.stdout
    last = evals(one)[-1]
    names = [os.path.basename(f) for f in sources]
    weights = data.mixture([None] * 3, WEIGHTS, names).weights  # as rounded per MIX_BLOCK
    assert last["val_loss"] == pytest.approx(sum(
        w * last[f"val_loss/{n}"] for n, w in zip(names, weights)), rel=1e-12)
    assert f"val loss {last['val_loss']:.4f} ({names[0]} " in p.stdout


@pytest.mark.slow
def test_a_single_source_is_data_dir(env, corpus, tmp_path):
    args = [*TINY, "--gradient_accumulation_steps=1", "--max_iters=3", "--eval_interval=3"]
    python("train.py", f"--data_dir={corpus}", f"--out_dir={tmp_path / 'dir'}", *args, env=env)
    python("train.py", f"--data_mix={corpus}", f"--out_dir={tmp_path / 'mix'}", *args, env=env)
    assert batches_and_losses(tmp_path / "dir", range(3)) == \
        batches_and_losses(tmp_path / "mix", range(3))
    assert evals(tmp_path / "dir") == evals(tmp_path / "mix")


@pytest.mark.slow
def test_new_weights_on_resume_go_on_from_the_same_sample_and_say_so(env, sources, mixture_run,
                                                                     tmp_path):
    out = str(tmp_path / "out")  # a copy of the mixture's 1-rank run, stopped at 6 of 6 steps
    shutil.copytree(mixture_run[0], out)
    p = python("train.py", mix_arg(sources, (0.1, 0.1, 0.8)), f"--out_dir={out}", *MIX_RUN,
               "--max_iters=8", "--init_from=resume", env=env)
    assert "note: data_mix was" in p.stdout and "differs from here on" in p.stdout
    assert sorted(steps(out)) == list(range(8))


@pytest.mark.parametrize("case, named", [
    ("unknown folder", ["data_mix source", "nowhere", "is not a folder"]),
    ("weight 0", ["=0'", "weight must be a number above 0"]),
    ("negative weight", ["=-1'", "weight must be a number above 0"]),
    ("weight not a number", ["=lots'", "weight must be a number above 0"]),
    ("other tokenizers", ["not made with one tokenizer", "'gpt2', 50257 ids"]),
    ("with data_dir", ["data_dir=", "are both set", "keep data_mix"]),
])
def test_bad_mixtures(case, named, env, sources, tmp_path):
    mix = {"unknown folder": mix_arg([*sources[:2], str(tmp_path / "nowhere")]),
           "weight 0": mix_arg(sources, (1, 1, 0)),
           "negative weight": mix_arg(sources, (1, 1, -1)),
           "weight not a number": mix_arg(sources, (1, 1, "lots")),
           "other tokenizers": mix_arg([*sources[:2], byte_folder(
               tmp_path / "gpt2", 20_000, 3, tokenizer="gpt2", vocab=50257)]),
           "with data_dir": mix_arg(sources)}[case]
    extra = [f"--data_dir={sources[0]}"] if case == "with data_dir" else []
    err = fails("train.py", mix, *extra, f"--out_dir={tmp_path / 'out'}", *TINY,
                "--max_iters=1", env=env).stderr
    assert all(n in err for n in named), err


def test_sources_of_one_folder_name_are_named_apart(tmp_path):
    """Their val losses are logged by name: the third data/web was named web-2 as the second."""
    folders = [tmp_path / where / "web" for where in ("a", "b", "c")]
    for folder in folders:
        folder.mkdir(parents=True)
    mix = parse_mix(",".join(f"{folder}=1" for folder in folders))
    assert [s.name for s in mix] == ["web", "web-2", "web-3"]


def test_a_weight_too_small_for_any_sample_is_an_error():
    with pytest.raises(data.UserError, match="below 1/1,048,576 of the total gets no samples"):
        data.mixture([None, None], (1.0, 1e-9), ("big", "tiny"))


def test_weights_near_the_largest_float_are_shares_like_any_others():
    """a=1e308,b=1e308 summed to infinity: '0.00% of the samples', then an IndexError."""
    huge = data.mixture([None, None], (1e308, 1e308), ("a", "b"))
    assert huge.counts == data.mixture([None, None], (1, 1), ("a", "b")).counts


def test_a_config_files_data_dir_gives_way_to_a_later_data_mix(env, sources, tmp_path):
    """The README's `train.py config/owt.py --data_mix=...` was refused: data_dir and data_mix
    'both set', with no word that data_dir came from the config file."""
    args = [f"--out_dir={tmp_path / 'out'}", *TINY, "--compile=False", "--max_iters=1",
            "--gradient_accumulation_steps=1", "--eval_iters=1", "--log_interval=1"]
    p = python("train.py", "config/owt.py", mix_arg(sources[1:], (1, 1)), *args, env=env)
    assert f"note: data_mix='{sources[1]}=1,{sources[2]}=1' (argument --data_mix=" \
           f"{sources[1]}=1,{sources[2]}=1) replaces data_dir='data/openwebtext' (config file " \
           f"config/owt.py)" in p.stdout, p.stdout
    assert "50.00% of the samples" in p.stdout


@pytest.mark.slow
def test_gpt2_and_r50k_base_sources_are_one_vocabulary(env, tmp_path):
    """tiktoken's two names of GPT-2's vocabulary were refused as different tokenizers."""
    folders = [byte_folder(tmp_path / name, 20_000, k, tokenizer=name, vocab=50257)
               for k, name in enumerate(("gpt2", "r50k_base"))]
    p = python("train.py", mix_arg(folders, (1, 1)), f"--out_dir={tmp_path / 'out'}", *TINY,
               "--max_iters=1", "--gradient_accumulation_steps=1", "--eval_iters=1", env=env)
    assert "r50k_base (" in p.stdout and "50.00% of the samples" in p.stdout
