"""sampling='documents': every window of an epoch starts at a document's start, each start once;
the same global batches on any world size and an exact resume, with real torchrun processes;
mixtures, shards and llm.c shards in this mode; the document index that prepare.py writes, and
that index_documents.py makes the same for nanoGPT's and llm.c's files; the document-aligned
val loss; and clear errors for a missing, damaged or stale index."""
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from ddpgpt import data, docindex, loader, sources, tokenfile
from conftest import (TINY, evals, fails, python, read_with_ranks,
                      same_on_any_world_size_and_resumed, steps, write_token_files)

EOT, BLOCK = 65535, 32  # a vocabulary of 65,536: the counting tokens fit below the end-of-text


def counting_documents(folder, sizes, seed=0):
    """A train split of shards (sizes tokens each) whose token at split offset i is i, but for
    the end-of-text that ends each document, with documents of 2 to 120 tokens: a window's
    first token names where it starts. Its index is made with index_documents.py, as a user
    makes it. Returns the folder and every start that block_size=BLOCK gives, from the
    tokens (each file's first token and each one after an end-of-text; then every BLOCK-th
    while the document has targets left)."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    shards, first, starts = [], 0, []
    for k, n in enumerate(sizes):
        tokens = np.arange(first, first + n)
        ends = np.cumsum(rng.integers(2, 121, n))
        tokens[ends[ends <= n] - 1] = EOT
        path = os.path.join(folder, f"train_{k:06d}.bin")
        tokens.astype(np.uint16).tofile(path)
        shards.append({"file": os.path.basename(path), "tokens": n, "documents": 0,
                       "fingerprint": tokenfile.sampled_fingerprint([path])})
        heads = [0] + [p + 1 for p in np.flatnonzero(tokens == EOT).tolist() if p + 1 < n]
        for a, b in zip(heads, heads[1:] + [n]):
            starts += [first + a + j for j in range(0, b - a - 1, BLOCK)]
        first += n
    val = os.path.join(folder, "val.bin")
    np.arange(3000, dtype=np.uint16).tofile(val)
    paths = [os.path.join(folder, s["file"]) for s in shards]
    tokenfile.write_meta(str(folder), tokenizer="test", vocab_size=EOT + 1, eot_token=EOT,
                         splits={"train": {"tokens": first, "documents": 0, "shards": shards,
                                           "fingerprint": tokenfile.sampled_fingerprint(paths)},
                                 "val": tokenfile.describe_split(val, np.uint16, 1)})
    return str(folder), sorted(starts)


def by_sample(ranks, micro_steps, batch):
    """{global sample index: (its window's first token, its targets)} of what the ranks read."""
    read = {}
    for r in ranks:
        for row in r["reads"]:
            assert row["shift_ok"]
            first = ((row["step"] * micro_steps + row["micro"]) * r["world"] + r["rank"]) * batch
            for j, (token, targets) in enumerate(zip(row["first_tokens"], row["targets"])):
                read[first + j] = token, targets
    return read


@pytest.mark.slow
def test_every_window_of_an_epoch_starts_at_a_document_start_once(env, tmp_path):
    sizes = [2000, 37, 1500, 0, 3000]  # a shard shorter than a block, and an empty one
    folder, starts = counting_documents(tmp_path / "shards", sizes)
    python("index_documents.py", f"--data_dir={folder}", env=env)
    n, out = len(starts), str(tmp_path / "read")
    steps_per_epoch = -(-n // 16)  # global batches of 2 ranks x 2 micro-steps x 4
    two = by_sample(read_with_ranks(env, folder, out, nproc=2, micro_steps=2,
                                    steps=steps_per_epoch + 1, batch=4, block=BLOCK,
                                    mode="documents"), 2, 4)
    assert sorted(two[i][0] for i in range(n)) == starts  # every start once, nothing else
    later = [two[i][0] for i in range(n, len(two))]  # epoch 1: starts in another order
    assert set(later) <= set(starts) and later != [two[i][0] for i in range(len(later))]
    ends = np.cumsum(sizes)
    for token, targets in two.values():  # a window that meets its file's end stops there
        end = int(ends[np.searchsorted(ends, token, side="right")])
        assert targets == min(BLOCK, end - token - 1) >= 1
    # any world size reads the same global batches, and a resumed reader goes on exactly
    one = by_sample(read_with_ranks(env, folder, out, nproc=1, micro_steps=4, steps=4,
                                    batch=4, block=BLOCK, mode="documents"), 4, 4)
    assert one == {i: two[i] for i in range(len(one))}
    resumed = by_sample(read_with_ranks(env, folder, out, nproc=2, micro_steps=2, start_step=2,
                                        steps=2, batch=4, block=BLOCK, mode="documents"), 2, 4)
    assert resumed == {i: two[i] for i in range(32, 64)}


def write_corpus(path, n_docs, seed):
    rng = np.random.default_rng(seed)
    words = ["the", "data", "document", "token", "résumé", "GPU", "naïve", "epoch", "\n\n"]
    with open(path, "w") as f:
        for d in range(n_docs):
            f.write(json.dumps({"text": " ".join(rng.choice(words, 3 + d * 7 % 150))}) + "\n")


def prepare(env, corpus, out_dir, *extra, tokenizer="gpt2"):
    python("prepare.py", f"--dataset={corpus}", f"--out_dir={out_dir}",
           f"--tokenizer={tokenizer}", "--val_fraction=0.05", "--num_proc=1", *extra, env=env)
    return str(out_dir)


def indexes(folder):
    return {split: (folder / f"{split}.docidx").read_bytes() for split in tokenfile.SPLITS}


@pytest.fixture(scope="module")
def gpt2_sources(session_env, tmp_path_factory):
    """Two GPT-2 sources: ddpgpt shards, and llm.c shards without meta.json or index, as
    they come from modded-nanogpt, indexed with index_documents.py; the index it makes is
    byte for byte the one prepare.py wrote. No test changes them."""
    env, tmp_path = session_env, tmp_path_factory.mktemp("gpt2_sources")
    write_corpus(tmp_path / "web.jsonl", 600, seed=0)
    write_corpus(tmp_path / "code.jsonl", 400, seed=1)
    web = prepare(env, tmp_path / "web.jsonl", tmp_path / "web", "--shard_tokens=20000")
    code = tmp_path / "code"
    prepare(env, tmp_path / "code.jsonl", code, "--format=llmc", "--shard_tokens=20000")
    written = indexes(code)
    for name in (tokenfile.META_NAME, "train.docidx", "val.docidx"):
        (code / name).unlink()
    p = python("index_documents.py", f"--data_dir={code}", env=env)
    assert "documents end with token 50256" in p.stdout and indexes(code) == written
    return web, str(code)


def mix_args(gpt2_sources):
    web, code = gpt2_sources
    return [f"--data_mix={web}=0.6,{code}=0.4", *TINY, "--gradient_accumulation_steps=2",
            "--eval_interval=3", "--sampling=documents"]


@pytest.fixture(scope="module")
def epoch_run(gpt2_sources, session_env, tmp_path_factory):
    """The mixture trained 1 step with sampling='epoch' (after --sampling=documents, which it
    overrides): its out_dir, with the checkpoint at iter 1."""
    epoch = str(tmp_path_factory.mktemp("epoch_run") / "out")
    python("train.py", *mix_args(gpt2_sources), f"--out_dir={epoch}", "--max_iters=1",
           "--sampling=epoch", env=session_env)
    return epoch


@pytest.mark.slow
def test_mixtures_of_shards_and_llmc_shards_train_the_same_batches_on_any_world_size(
        env, gpt2_sources, epoch_run, tmp_path):
    one, p = same_on_any_world_size_and_resumed(mix_args(gpt2_sources), tmp_path, env)
    assert "document starts by max_iters" in p.stdout
    last = evals(one)[-1]  # beside the fixed windows' loss, the document-aligned one
    assert {"val_loss", "val_loss_docs", "val_loss_docs/web", "val_loss_docs/code"} <= set(last)
    assert last["val_loss_docs"] == pytest.approx(
        0.6 * last["val_loss_docs/web"] + 0.4 * last["val_loss_docs/code"], rel=1e-6)
    assert steps(epoch_run)[0]["batch_fp"] != steps(one)[0]["batch_fp"]


@pytest.mark.slow
def test_a_resume_in_another_sampling_mode_says_so(env, gpt2_sources, epoch_run, tmp_path):
    """epoch -> documents on a resume: the run goes on from its sample count in another order,
    and says so as a data_mix change does (was: without a word)."""
    out = str(tmp_path / "out")  # a copy of the 1 step trained with sampling='epoch'
    shutil.copytree(epoch_run, out)
    p = python("train.py", *mix_args(gpt2_sources), f"--out_dir={out}", "--max_iters=2",
               "--init_from=resume", env=env)
    assert "note: sampling was 'epoch' and is now 'documents': the run goes on from the same " \
           "global sample, but from here on its windows are drawn as sampling='documents' draws " \
           "them" in p.stdout


@pytest.mark.slow
def test_index_of_nanogpt_files_is_prepares_and_a_stale_one_is_refused(env, corpus, tmp_path):
    raw = tmp_path / "raw"  # nanoGPT's: the corpus's train.bin and val.bin, no meta.json
    raw.mkdir()
    for split in tokenfile.SPLITS:
        shutil.copy(os.path.join(corpus, f"{split}.bin"), raw)
    python("index_documents.py", f"--data_dir={raw}", "--eot_token=256", env=env)
    assert indexes(raw) == indexes(Path(corpus))  # what prepare.py wrote beside them
    p = python("index_documents.py", f"--data_dir={raw}", "--eot_token=256", env=env)
    assert "train.docidx matches its token files: kept" in p.stdout
    run = [f"--data_dir={raw}", f"--out_dir={tmp_path / 'out'}", *TINY, "--max_iters=3",
           "--eval_interval=3", "--gradient_accumulation_steps=1", "--sampling=documents"]
    python("train.py", *run, env=env)
    recorded = evals(tmp_path / "out")[-1]["val_loss_docs"]
    p = python("eval.py", f"--out_dir={tmp_path / 'out'}", f"--data_dir={raw}", "--hellaswag=False",
               "--eval_iters=4", "--batch_size=4", "--block_size=32", env=env)
    assert json.loads(p.stdout.splitlines()[-1])["val_loss_docs"] == pytest.approx(recorded,
                                                                                  abs=1e-6)
    tokens = np.fromfile(raw / "train.bin", dtype=np.uint16)  # other tokens, of the same size
    np.roll(tokens, 1).tofile(raw / "train.bin")
    err = fails("train.py", *run, f"--out_dir={tmp_path / 'stale'}", env=env).stderr
    assert "train.docidx is the document index of other token files than" in err
    assert f"python index_documents.py --data_dir={raw}" in err
    p = python("index_documents.py", f"--data_dir={raw}", "--eot_token=256", env=env)
    assert "train.docidx matches" not in p.stdout and "val.docidx matches" in p.stdout
    python("train.py", *run, f"--out_dir={tmp_path / 'again'}", env=env)


@pytest.mark.parametrize("case, words", [
    ("missing", ["train.docidx does not exist: it is the document index of",
                 "which sampling='documents' reads"]),
    ("cut short", ["is not a document index that this code reads", "cut short"]),
    ("damaged", ["does not match its own fingerprint"]),
    ("another folder's", ["is the document index of other token files than"]),
    ("at another end-of-text id", ["train.docidx ends documents at end-of-text id 10, but ",
                                   "('byte' tokens) end them at end-of-text id 256: it cuts"]),
])
@pytest.mark.slow
def test_a_missing_damaged_or_stale_index_is_one_clear_error(case, words, env, corpus, tmp_path):
    """An index at another end-of-text id than meta.json's, made on a copy of the token files
    without it (or before index_documents.py refused such an --eot_token), was read: a byte
    corpus's documents cut at every newline."""
    folder = tmp_path / "data"
    shutil.copytree(corpus, folder)
    index = folder / "train.docidx"
    if case == "at another end-of-text id":
        copy = tmp_path / "copy"
        shutil.copytree(corpus, copy, ignore=shutil.ignore_patterns("meta.json", "*.docidx"))
        python("index_documents.py", f"--data_dir={copy}", "--eot_token=10", env=env)
        shutil.copy(copy / "train.docidx", index)
    elif case == "missing":
        index.unlink()
    elif case == "cut short":
        os.truncate(index, index.stat().st_size - 8)
    elif case == "damaged":  # one byte of a start changed
        with open(index, "r+b") as f:
            f.seek(docindex.DOCS_HEADER_BYTES)
            byte = f.read(1)[0]
            f.seek(docindex.DOCS_HEADER_BYTES)
            f.write(bytes([byte ^ 0xFF]))
    else:
        shutil.copy(os.path.join(corpus, "val.docidx"), index)
    err = fails("train.py", f"--data_dir={folder}", f"--out_dir={tmp_path / 'out'}", *TINY,
                "--max_iters=1", "--sampling=documents", env=env).stderr
    assert all(w in err for w in words), err
    assert f"Make it{' again' if case != 'missing' else ''} with `python index_documents.py " \
           f"--data_dir={folder}`" in err


def test_block_dataset_in_documents_mode_reads_what_the_trainer_reads(tmp_path):
    folder, starts = counting_documents(tmp_path / "one", [5000])
    with pytest.raises(ValueError, match="open the split with sources.open_split"):
        loader.BlockDataset(tokenfile.open_split(folder, "train", BLOCK), BLOCK, mode="documents")
    with pytest.raises(tokenfile.UserError, match="train.docidx does not exist"):
        sources.open_split(folder, "train", BLOCK, mode="documents")
    write_token_files(folder, {"train": np.fromfile(
        os.path.join(folder, "train_000000.bin"), dtype=np.uint16)}, tokenizer="test",
        vocab_size=EOT + 1, eot_token=EOT)  # train.bin and its index, as a test folder has
    token_split = sources.open_split(folder, "train", BLOCK, mode="documents")
    dataset = loader.BlockDataset(token_split, BLOCK, seed=7, mode="documents")
    assert len(dataset) == len(starts)
    workers = torch.utils.data.DataLoader(
        dataset, batch_size=4, num_workers=2,
        sampler=loader.RankSampler(4, rank=1, world_size=2, micro_steps=3, num_steps=2))
    trainer = loader.rank_batches(data.mixture([token_split]), block_size=BLOCK, batch_size=4,
                                  micro_steps=3, rank=1, world_size=2, seed=7, mode="documents",
                                  start_step=0, device="cpu", vocab_size=EOT + 1)
    for x, y in workers:
        expected = next(trainer)
        assert torch.equal(x, expected[0]) and torch.equal(y, expected[1])
        assert set(x[:, 0].tolist()) <= set(starts)


def test_index_documents_on_a_folder_without_token_files_writes_nothing(env, tmp_path):
    err = fails("index_documents.py", f"--data_dir={tmp_path / 'nowhere'}", env=env).stderr
    assert err.startswith("index_documents.py: error: ") and "train.bin does not exist" in err
    assert "python prepare.py" in err and not (tmp_path / "nowhere").exists()


def test_an_eot_token_other_than_meta_jsons_is_refused_and_the_index_kept(env, corpus, tmp_path):
    """A byte corpus indexed at newlines: its documents became thousands of lines, replacing a
    good index without a word, and train.py trained on them."""
    folder = tmp_path / "data"
    shutil.copytree(corpus, folder)
    before = indexes(folder)
    err = fails("index_documents.py", f"--data_dir={folder}", "--eot_token=10", env=env).stderr
    assert err.strip() == (
        f"index_documents.py: error: --eot_token=10 disagrees with {folder}/meta.json, which "
        f"gives its tokens (tokenizer 'byte') eot_token 256: prepare.py ended every document "
        f"with that, and an index at another id would cut them elsewhere. Leave --eot_token "
        f"out to index at meta.json's (it is for folders without one: nanoGPT's and llm.c's)."), err
    assert indexes(folder) == before
    p = python("index_documents.py", f"--data_dir={folder}", "--eot_token=256", env=env)
    assert "train.docidx matches its token files: kept" in p.stdout


@pytest.fixture
def read_only(tmp_path):
    """read_only(folder): a path to folder that cannot be written in, also by root (a read-only
    bind mount; without root, the folder with its write permission taken away)."""
    undo = []

    def view(folder):
        if os.geteuid() != 0:
            os.chmod(folder, 0o555)
            undo.append(["chmod", "755", str(folder)])
            return folder
        mount = tmp_path / "read_only"
        mount.mkdir()
        subprocess.run(["mount", "--bind", str(folder), str(mount)], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(mount)], check=True)
        undo.append(["umount", str(mount)])
        return mount
    yield view
    for command in undo:
        subprocess.run(command, check=True)


def test_index_documents_on_a_read_only_folder_says_to_copy_it(env, corpus, tmp_path, read_only):
    """It said 'choose a folder', but the index can only go beside the token files."""
    (tmp_path / "data").mkdir()
    for split in tokenfile.SPLITS:
        shutil.copy(os.path.join(corpus, f"{split}.bin"), tmp_path / "data")
    folder = read_only(tmp_path / "data")
    err = fails("index_documents.py", f"--data_dir={folder}", env=env).stderr
    assert err.strip().endswith(
        f"each index goes beside its token files, so copy {folder} to a place you can write "
        f"in and run index_documents.py on the copy."), err


@pytest.mark.slow
def test_a_split_of_end_of_text_ids_alone_is_named(env, tmp_path):
    """It was an IndexError from data.document_runs, in documents mode and through the val
    split's index in the default mode."""
    text = np.tile(np.append(np.arange(40), EOT), 50)
    folder = str(tmp_path / "data")
    write_token_files(folder, {"train": text, "val": np.full(100, EOT)}, tokenizer="test",
                      vocab_size=EOT + 1, eot_token=EOT)
    run = [f"--data_dir={folder}", *TINY, "--max_iters=1", "--eval_iters=1"]
    p = python("train.py", *run, f"--out_dir={tmp_path / 'epoch'}", env=env)
    assert ("note: the evaluations leave the document-aligned val loss (val_loss_docs) out: "
            f"{folder}/val.bin holds no document of two tokens or more") in p.stdout, p.stdout
    write_token_files(folder, {"train": np.full(100, EOT), "val": text}, tokenizer="test",
                      vocab_size=EOT + 1, eot_token=EOT)
    err = fails("train.py", *run, f"--out_dir={tmp_path / 'docs'}", "--sampling=documents",
                env=env).stderr
    assert f"{folder}/train.bin holds no document of two tokens or more" in err, err
