"""data.py: O(1) sampling, exact epochs, rank disjointness, world-size invariance, resume,
files opened only to read a batch, and clear errors for bad token files."""
import os
import pickle
import subprocess

import numpy as np
import pytest
import torch

from ddpgpt import data, loader, permutation, tokenfile
from conftest import TINY, fails, global_batches, python, read_with_ranks, write_token_files
from ddpgpt.errors import UserError


@pytest.fixture
def counting_data(tmp_path):
    """A split whose token at offset i is i, so every window names its own offset."""
    folder = str(tmp_path / "counting")
    n = 50_000
    write_token_files(folder, {"train": np.arange(n), "val": np.arange(5_000)},
                                tokenizer="test", vocab_size=n + 1, eot_token=n)
    return folder, n


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 17, 255, 1000, 4099])
def test_permute_is_a_bijection(n):
    for key in (0, 1, 12345):
        assert sorted(permutation.permute(np.arange(n), n, key).tolist()) == list(range(n))


def test_epoch_mode_reads_every_block_once_per_epoch_in_a_new_order():
    n_tokens, block = 10_007, 64
    per_epoch = data.blocks_per_epoch(n_tokens, block)
    assert per_epoch == (n_tokens - 1) // block - 1
    orders, phases = [], set()
    for epoch in range(4):
        g = np.arange(epoch * per_epoch, (epoch + 1) * per_epoch)
        offsets = data.sample_offsets(g, [0, n_tokens], block, seed=3, mode="epoch")
        phase = int(offsets.min())
        assert phase < block
        assert sorted(((offsets - phase) // block).tolist()) == list(range(per_epoch))
        assert ((offsets - phase) % block == 0).all() and offsets.max() + block + 1 <= n_tokens
        orders.append(offsets.tolist())
        phases.add(phase)
    assert len({tuple(o) for o in orders}) == 4, "each epoch must have its own order"
    assert len(phases) > 1, "block boundaries must shift between epochs"


def test_random_mode_stays_in_range_and_depends_on_seed():
    g = np.arange(100_000)
    a = data.sample_offsets(g, [0, 5_000], 100, seed=1, mode="random")
    assert a.min() >= 0 and a.max() <= 5_000 - 100 - 1
    assert len(np.unique(a)) > 4_800  # covers nearly every one of the 4,900 offsets
    assert not np.array_equal(a, data.sample_offsets(g, [0, 5_000], 100, seed=2, mode="random"))


def test_sampling_needs_no_memory_of_the_dataset_size():
    # a sample of a 9e9-token file (OpenWebText) costs what a sample of a tiny one does
    for mode in ("epoch", "random"):  # documents: tests/test_documents.py
        offsets = data.sample_offsets(np.arange(10**12, 10**12 + 480), [0, 9 * 10**9], 1024, 1,
                                      mode)
        assert offsets.min() >= 0 and offsets.max() + 1025 <= 9 * 10**9


def test_token_file_pickles_without_its_data(counting_data):
    folder, n = counting_data
    tokens = tokenfile.open_split(folder, "train", 64)
    blob = pickle.dumps(loader.BlockDataset(tokens, 64))
    assert len(blob) < 1000
    x, y = pickle.loads(blob)[5]
    assert torch.equal(x[1:], y[:-1])


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_dataloader_workers_read_the_same_batches_as_the_trainer(counting_data, start_method):
    folder, n = counting_data
    tokens = tokenfile.open_split(folder, "train", 32)
    workers = torch.utils.data.DataLoader(
        loader.BlockDataset(tokens, 32, seed=7), batch_size=4, num_workers=2,
        multiprocessing_context=start_method,
        sampler=loader.RankSampler(4, rank=1, world_size=2, micro_steps=3, num_steps=2))
    from_loader = [x for x, _ in workers]
    trainer = loader.rank_batches(data.mixture([tokens]), block_size=32, batch_size=4,
                                  micro_steps=3, rank=1, world_size=2, seed=7, mode="epoch",
                                  start_step=0, device="cpu", vocab_size=n + 1)
    assert len(from_loader) == 6
    for x in from_loader:
        assert torch.equal(x, next(trainer)[0])


@pytest.mark.slow
def test_global_batches_are_the_same_for_any_world_size_split_and_resume(
        env, counting_data, tmp_path):
    folder, _ = counting_data
    out = str(tmp_path / "read")
    one_by_four = read_with_ranks(env, folder, out, nproc=1, micro_steps=4, steps=4)
    two_by_two = read_with_ranks(env, folder, out, nproc=2, micro_steps=2, steps=4)
    resumed = read_with_ranks(env, folder, out, nproc=2, micro_steps=2, start_step=2, steps=2)
    reference = global_batches(one_by_four)
    assert all(len(v) == 16 for v in reference.values())
    assert global_batches(two_by_two) == reference
    assert global_batches(resumed) == {s: reference[s] for s in (2, 3)}
    # the two ranks read disjoint slices of each global batch
    for step in reference:
        seen = [set(o for read in r["reads"] if read["step"] == step
                    for o in read["first_tokens"]) for r in two_by_two]
        assert not seen[0] & seen[1]
    # 4 ranks x 1 micro-step, in random mode too
    random_1 = global_batches(read_with_ranks(env, folder, out, 1, 4, mode="random"))
    random_4 = global_batches(read_with_ranks(env, folder, out, 4, 1, mode="random"))
    assert random_1 == random_4


@pytest.mark.slow
def test_sixteen_gib_file_costs_eight_ranks_no_more_memory_than_sixteen_mib(env, tmp_path):
    rss = {}
    for name, size in (("small", 16 * 2**20), ("huge", 16 * 2**30)):
        folder = tmp_path / name
        folder.mkdir()
        for split in tokenfile.SPLITS:  # sparse: nothing is written, the files read as zeros
            subprocess.run(["truncate", "-s", str(size), str(folder / f"{split}.bin")], check=True)
        ranks = read_with_ranks(env, str(folder), str(tmp_path / name), nproc=8,
                                micro_steps=1, steps=2, batch=12, block=1024)
        rss[name] = max(r["rss_first_batch"] for r in ranks)
        assert all(len(r["reads"]) == 2 for r in ranks)
    assert rss["huge"] < rss["small"] + 16 * 2**20, rss


# ---- the data API as docs/data.md shows it: every argument checked when the object is made ----

@pytest.mark.parametrize("kwargs, error, words", [
    ({"batch_size": 0}, ValueError, "batch_size=0 must be >= 1"),  # looped forever, yielding none
    ({"batch_size": 4.0}, TypeError, "batch_size must be an int, not float"),
    ({"batch_size": 4, "rank": 2, "world_size": 2}, ValueError, "rank=2 must be in [0, 1]"),
    ({"batch_size": 4, "rank": -1}, ValueError, "rank=-1 must be in [0, 0]"),
    ({"batch_size": 4, "world_size": 0}, ValueError, "world_size=0 must be >= 1"),
    ({"batch_size": 4, "micro_steps": 0}, ValueError, "micro_steps=0 must be >= 1"),
    ({"batch_size": 4, "start_step": -3}, ValueError, "start_step=-3 must be >= 0"),
    ({"batch_size": 4, "num_steps": -1}, ValueError, "num_steps=-1 must be >= 0"),
    ({"batch_size": "4"}, TypeError, "batch_size must be an int, not str '4'"),
], ids=["zero batch", "float batch", "rank too large", "negative rank", "zero world",
        "zero micro-steps", "negative start", "negative steps", "str batch"])
def test_rank_sampler_refuses_bad_arguments_when_made(kwargs, error, words):
    with pytest.raises(error) as e:
        loader.RankSampler(**kwargs)
    assert words in str(e.value)


def test_rank_sampler_takes_numpy_integers():
    sampler = loader.RankSampler(np.int64(2), rank=np.int32(1), world_size=2, num_steps=1)
    assert list(sampler) == [2, 3]


@pytest.mark.parametrize("make, error, words", [
    (lambda t, folder: loader.BlockDataset(folder, 32), TypeError,
     "BlockDataset takes a tokenfile.TokenSplit, such as tokenfile.open_split("),
    (lambda t, folder: loader.BlockDataset(t, 0), ValueError, "block_size=0 must be >= 1"),
    (lambda t, folder: loader.BlockDataset(t, 32.5), TypeError, "block_size must be an int"),
    (lambda t, folder: loader.BlockDataset(t, 32, seed=1.5), TypeError, "seed must be an int"),
    (lambda t, folder: loader.BlockDataset(t, 32, mode="shuffle"), ValueError,
     "'shuffle' is not one of ('epoch', 'random', 'documents')"),
    # the Feistel cycle-walk spun forever on an empty range of blocks
    (lambda t, folder: loader.BlockDataset(t, 50_000), UserError,
     "holds 50000 tokens, fewer than one block of block_size=50000 plus the shifted target: "
     "set block_size to at most 49999"),
    (lambda t, folder: loader.BlockDataset(t, 50_000, mode="random"), UserError,
     "fewer than one block"),
], ids=["a path", "zero block", "float block", "float seed", "unknown mode",
        "block longer than the split", "same, random mode"])
def test_block_dataset_refuses_bad_arguments_when_made(counting_data, make, error, words):
    folder, _ = counting_data
    token_split = tokenfile.open_split(folder, "train", 32)
    with pytest.raises(error) as e:
        make(token_split, folder)
    assert words in str(e.value)


def test_block_dataset_indexing_follows_python(counting_data):
    """Any index from 0 is a sample (beyond len(), later epochs); a negative one is an
    IndexError, not counted from an end the dataset does not have; a float is a TypeError."""
    folder, n = counting_data
    dataset = loader.BlockDataset(tokenfile.open_split(folder, "train", 32), 32, seed=3)
    x, y = dataset[len(dataset) + 5]  # epoch 1
    assert torch.equal(x[1:], y[:-1]) and torch.equal(dataset[np.int64(7)][0], dataset[7][0])
    for bad, error in ((-1, IndexError), (2**63, IndexError), (1.0, TypeError), ("1", TypeError)):
        with pytest.raises(error):
            dataset[bad]
    with pytest.raises(IndexError, match="negative ones do not count from the end"):
        dataset[-len(dataset)]


# ---- bad token files: what train.py says, before any step ----

ONE_STEP = [*TINY, "--batch_size=2", "--gradient_accumulation_steps=1", "--max_iters=1",
            "--eval_iters=1"]


def train_error(env, folder, tmp_path, *extra):
    return fails("train.py", f"--data_dir={folder}", f"--out_dir={tmp_path / 'out'}",
                 *ONE_STEP, *extra, env=env).stderr


def small_folder(tmp_path, n=1000, vocab=257, meta=True):
    folder = str(tmp_path / "d")
    rng = np.random.default_rng(0)
    ids = {split: rng.integers(0, vocab - 1, n) for split in tokenfile.SPLITS}
    write_token_files(folder, ids, tokenizer="test", vocab_size=vocab, eot_token=vocab - 1)
    if not meta:
        os.remove(os.path.join(folder, tokenfile.META_NAME))
    return folder


def test_missing_file_names_the_path_and_the_prepare_command(env, tmp_path):
    folder = small_folder(tmp_path)
    os.remove(os.path.join(folder, "val.bin"))
    err = train_error(env, folder, tmp_path)
    assert "val.bin does not exist" in err and \
        f"python prepare.py --dataset=<corpus> --out_dir={folder}` (the corpus: a file, a " \
        f"folder or a hub dataset; left out, it is OpenWebText, a 13 GB download)" in err, err


def test_odd_sized_file_is_not_a_whole_number_of_tokens(env, tmp_path):
    folder = small_folder(tmp_path, meta=False)
    with open(os.path.join(folder, "train.bin"), "ab") as f:
        f.write(b"\0")
    err = train_error(env, folder, tmp_path)
    assert "2001 bytes" in err and "not a whole number of uint16 tokens" in err


def test_truncated_file_disagrees_with_meta(env, tmp_path):
    folder = small_folder(tmp_path)
    path = os.path.join(folder, "train.bin")
    os.truncate(path, os.path.getsize(path) - 20)
    err = train_error(env, folder, tmp_path)
    assert "990 tokens" in err and "says 1000" in err


def test_replaced_file_of_the_same_size_fails_the_fingerprint(env, tmp_path):
    folder = small_folder(tmp_path)
    np.zeros(1000, dtype=np.uint16).tofile(os.path.join(folder, "train.bin"))
    assert "does not match the fingerprint" in train_error(env, folder, tmp_path)


def test_split_shorter_than_one_block(env, tmp_path):
    folder = small_folder(tmp_path, n=20)
    err = train_error(env, folder, tmp_path)
    assert "fewer than one block of block_size=32" in err and "at most 19" in err


def test_vocabulary_larger_than_the_model(env, tmp_path):
    folder = small_folder(tmp_path, vocab=70000)
    err = train_error(env, folder, tmp_path, "--vocab_size=512")
    assert f"{folder} ('test' tokens) has 70000 token ids, more than the 512 that the model " \
           f"embeds: use a model with vocab_size >= 70000" in err


@pytest.mark.slow
def test_token_ids_beyond_the_vocabulary_in_a_raw_file(env, tmp_path):
    folder = small_folder(tmp_path, meta=False)
    np.full(1000, 60000, dtype=np.uint16).tofile(os.path.join(folder, "train.bin"))
    err = train_error(env, folder, tmp_path, "--vocab_size=512")
    assert "token id 60000" in err and "vocab_size is 512" in err


@pytest.mark.slow
def test_raw_nanogpt_files_are_read_as_uint16_with_a_notice(env, tmp_path):
    folder = small_folder(tmp_path, meta=False)
    p = python("train.py", f"--data_dir={folder}", f"--out_dir={tmp_path / 'out'}",
               *ONE_STEP, "--vocab_size=512", env=env)
    assert "no meta.json" in p.stdout and "raw uint16" in p.stdout

