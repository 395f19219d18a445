"""Shard sets and llm.c shards: one token space per split, every block once per epoch, the same
global batches on any world size, exact resume, the cross-rank identity check, a sharded
prepare that resumes after a kill, and clear errors for bad shards."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ddpgpt import data, tokenfile
from conftest import (ROOT, TINY, decoded, fails, global_batches, python, read_all,
                      read_with_ranks, same_on_any_world_size_and_resumed)
from ddpgpt.tokenizer import get_tokenizer


def write_llmc_shard(path, tokens, magic=20240520, version=1, count=None):
    """A shard as llm.c's data scripts write it: 256 int32 (magic, version, token count),
    then uint16 tokens. Written here from llm.c's description, not with our code."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, len(tokens) if count is None else count
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype="<u2").tobytes())


@pytest.fixture
def llmc_data(corpus, tmp_path):
    """The byte corpus as llm.c shards: val as one shard, train cut into three."""
    folder = tmp_path / "fineweb10B"
    folder.mkdir()
    train = np.fromfile(os.path.join(corpus, "train.bin"), dtype=np.uint16)
    write_llmc_shard(folder / "fineweb_val_000000.bin",
                     np.fromfile(os.path.join(corpus, "val.bin"), dtype=np.uint16))
    for i, part in enumerate(np.array_split(train, 3)):
        write_llmc_shard(folder / f"fineweb_train_{i + 1:06d}.bin", part)
    return str(folder)


@pytest.mark.slow
def test_llmc_shards_train_the_same_global_batches_on_any_world_size_and_resume_exactly(
        env, llmc_data, tmp_path):
    args = [f"--data_dir={llmc_data}", *TINY, "--gradient_accumulation_steps=2",
            "--eval_interval=3"]
    _, p = same_on_any_world_size_and_resumed(args, tmp_path, env)
    assert "vocab_size = 50304" in p.stdout  # GPT-2's, from the llm.c header's magic


# ---- a shard set is one token space ----

SIZES = [1000, 37, 500, 0, 2051]  # a shard shorter than one block, and an empty one


def counting_shards(folder, sizes=SIZES, fmt="raw"):
    """A train split of shards whose token at split offset i is i, with a meta.json listing
    them, and a val.bin: every window names where it starts."""
    os.makedirs(folder, exist_ok=True)
    shards, start = [], 0
    for k, n in enumerate(sizes):
        path = os.path.join(folder, f"train_{k:06d}.bin")
        np.arange(start, start + n, dtype=np.uint16).tofile(path)
        shards.append({"file": os.path.basename(path), "tokens": n, "documents": 1,
                       "fingerprint": tokenfile.sampled_fingerprint([path])})
        start += n
    paths = [os.path.join(folder, s["file"]) for s in shards]
    val = os.path.join(folder, "val.bin")
    np.arange(500, dtype=np.uint16).tofile(val)
    tokenfile.write_meta(folder, tokenizer="test", vocab_size=2**16, eot_token=0, splits={
        "train": {"tokens": start, "documents": len(sizes), "shards": shards,
                  "fingerprint": tokenfile.sampled_fingerprint(paths)},
        "val": tokenfile.describe_split(val, np.uint16, 1)})
    return str(folder)


def test_epoch_mode_reads_every_block_of_every_shard_once_and_never_across_shards():
    block, starts = 32, np.cumsum([0, *SIZES])
    blocks = data.blocks_per_epoch(np.array(SIZES), block)
    per_epoch = int(blocks.sum())
    assert per_epoch == sum(max((n - 1) // block, 0) - ((n - 1) // block >= 2) for n in SIZES)
    for epoch in range(3):
        i = np.arange(epoch * per_epoch, (epoch + 1) * per_epoch)
        offsets = data.sample_offsets(i, starts, block, seed=5, mode="epoch")
        shard = np.searchsorted(starts, offsets, side="right") - 1
        assert (offsets + block + 1 <= starts[shard + 1]).all(), "a window crossed a shard"
        phase = {k: int(offsets[shard == k].min() - starts[k]) for k in np.unique(shard)}
        assert all(p < block for p in phase.values())
        seen = sorted((int(k), int((o - starts[k] - phase[k]) // block))
                      for o, k in zip(offsets, shard))
        assert seen == [(k, b) for k in range(len(SIZES)) for b in range(blocks[k])]


def test_random_mode_draws_windows_uniformly_over_all_shards():
    block, starts = 32, np.cumsum([0, *SIZES])
    offsets = data.sample_offsets(np.arange(60_000), starts, block, seed=1, mode="random")
    shard = np.searchsorted(starts, offsets, side="right") - 1
    assert (offsets + block + 1 <= starts[shard + 1]).all()
    windows = np.maximum(np.array(SIZES) - block, 0)  # window starts in each shard
    share = np.bincount(shard, minlength=len(SIZES)) / len(offsets)
    assert np.allclose(share, windows / windows.sum(), atol=0.01)


def test_ten_thousand_shards_cost_no_per_sample_table():
    starts = np.cumsum([0] + [100_000] * 10_000)  # 1e9 tokens in 10,000 shards
    for mode in ("epoch", "random"):  # documents: tests/test_documents.py
        offsets = data.sample_offsets(np.arange(10**12, 10**12 + 480), starts, 1024, 1, mode)
        shard = np.searchsorted(starts, offsets, side="right") - 1
        assert (offsets + 1025 <= starts[shard + 1]).all()


@pytest.mark.slow
def test_shard_sets_read_the_same_global_batches_on_any_world_size(env, tmp_path):
    folder = counting_shards(tmp_path / "shards")
    out = str(tmp_path / "read")
    reference = global_batches(read_with_ranks(env, folder, out, nproc=1, micro_steps=4, steps=4))
    assert global_batches(read_with_ranks(env, folder, out, nproc=2, micro_steps=2,
                                          steps=4)) == reference
    resumed = read_with_ranks(env, folder, out, nproc=2, micro_steps=2, start_step=2, steps=2)
    assert global_batches(resumed) == {s: reference[s] for s in (2, 3)}


@pytest.mark.slow
def test_ranks_that_see_different_shards_stop_before_the_first_step(env, tmp_path):
    """Rank 1 is given a copy of the data with one shard fewer (tests/rank_data_dir.py)."""
    folder = counting_shards(tmp_path / "shards")
    counting_shards(tmp_path / "shards_rank1", sizes=SIZES[:-1])
    p = fails("tests/rank_data_dir.py", f"--data_dir={folder}", f"--out_dir={tmp_path / 'o'}",
              *TINY, "--vocab_size=65536", "--gradient_accumulation_steps=2", "--max_iters=2",
              env=env, nproc=2)
    assert "the ranks do not see the same data" in p.stderr
    assert not os.path.exists(tmp_path / "o" / "metrics.jsonl")


# ---- prepare.py --shard_tokens and --format=llmc ----

def write_corpus(path, n_docs, seed=0):
    rng = np.random.default_rng(seed)
    words = ["the", "data", "shard", "token", "résumé", "GPU", "naïve", "epoch", "\n\n"]
    with open(path, "w") as f:
        for d in range(n_docs):
            f.write(json.dumps({"text": " ".join(rng.choice(words, 200 + d % 300))}) + "\n")


def shards_args(corpus_path, out_dir, *extra):
    return [f"--dataset={corpus_path}", f"--out_dir={out_dir}", "--tokenizer=gpt2",
            "--val_fraction=0.01", "--num_proc=1", *extra]


def prepare_shards(env, corpus_path, out_dir, *extra):
    return python("prepare.py", *shards_args(corpus_path, out_dir, *extra), env=env)


def stopped_prepare(env, corpus_path, out_dir, shard, stop, *extra):
    """A sharded prepare stopped (stop, a signal) once it has published the train shard
    numbered shard: its exit code and stderr."""
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "prepare.py"),
                             *shards_args(corpus_path, out_dir, *extra)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (out_dir / f"train_{shard:06d}.bin").exists():
        assert proc.poll() is None and time.time() < deadline, "it ended before the kill"
        time.sleep(0.01)
    proc.send_signal(stop)
    stderr = proc.communicate(timeout=60)[1]
    return proc.returncode, stderr


@pytest.fixture(scope="module")
def whole_prepare(tmp_path_factory, session_env):
    """6,000 documents, and their sharded prepare never stopped: (the corpus, its output). Some
    30 shards of 100,000 tokens: a prepare killed once it has published its third has most of
    its work left."""
    root = tmp_path_factory.mktemp("whole_prepare")
    write_corpus(root / "docs.jsonl", 6_000)
    prepare_shards(session_env, root / "docs.jsonl", root / "whole", "--shard_tokens=100000")
    return root / "docs.jsonl", root / "whole"


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_stopped_sharded_prepare_resumes_and_writes_the_same_bytes(stop, env, tmp_path,
                                                                    monkeypatch, whole_prepare):
    """Killed, it leaves its lock and temporary files, which the next run takes over and
    removes; stopped (kill's SIGTERM), it removes them itself and says what it kept."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", env["TIKTOKEN_CACHE_DIR"])  # to decode here
    docs_jsonl, whole = whole_prepare
    shard = ["--shard_tokens=100000"]
    out = tmp_path / "killed"
    returncode, stderr = stopped_prepare(env, docs_jsonl, out, 2, stop, *shard)
    assert not (out / tokenfile.META_NAME).exists()
    if stop == signal.SIGTERM:
        assert returncode == 128 + stop and "Traceback" not in stderr, stderr
        progress = json.loads((out / "prepare.progress.json").read_text())
        kept = sum(map(len, progress["splits"].values()))
        assert stderr.strip().splitlines()[-1] == (
            f"prepare.py: interrupted (SIGTERM); this run's temporary files were removed, and "
            f"the {kept} complete shard(s) in {out} that prepare.progress.json records are "
            f"kept: the same command resumes after them."), stderr
        assert sorted(f for f in os.listdir(out) if not f.endswith(".bin")) == \
            ["prepare.progress.json"]
    p = prepare_shards(env, docs_jsonl, out, *shard)
    assert "resuming an interrupted run" in p.stdout
    assert ("taking over the lock on" in p.stdout) == (stop == signal.SIGKILL), p.stdout
    assert read_all(out) == read_all(whole)  # no temporary file or lock left
    meta = json.loads((out / tokenfile.META_NAME).read_text())
    assert len(meta["splits"]["train"]["shards"]) > 3
    docs = decoded_shards(out)
    assert len(docs) == 6_000


def test_a_resume_after_the_corpus_changed_starts_over(env, tmp_path):
    """Resumed with the old document count, it wrote other data than a fresh prepare does."""
    docs, shard = tmp_path / "docs", ["--shard_tokens=50000"]
    docs.mkdir()
    for k in range(6):
        write_corpus(docs / f"part{k}.jsonl", 400, seed=k)
    out = tmp_path / "out"
    stopped_prepare(env, docs, out, 1, signal.SIGKILL, *shard)  # at its second train shard
    for k in range(3):
        (docs / f"part{k + 3}.jsonl").unlink()
    p = prepare_shards(env, docs, out, *shard)
    assert f"prepare.py: {out} holds an interrupted run of a corpus that has changed since " \
           f"(files added, removed or edited: corpus '6 files, " in p.stdout, p.stdout
    assert "starting over" in p.stdout and "resuming" not in p.stdout
    prepare_shards(env, docs, tmp_path / "fresh", *shard)
    assert read_all(out) == read_all(tmp_path / "fresh")


def test_a_sharded_prepare_never_starts_over_a_complete_output(env, tmp_path):
    """Re-prepared with another seed and stopped at its first shard, it had deleted the old
    meta.json and replaced a shard: neither dataset was left. Now it is refused before it
    touches anything; the same command again has nothing to do."""
    write_corpus(tmp_path / "docs.jsonl", 2000)
    out, shard = tmp_path / "out", ["--shard_tokens=50000"]
    prepare_shards(env, tmp_path / "docs.jsonl", out, *shard)
    before = read_all(out)
    message = fails("prepare.py", *shards_args(tmp_path / "docs.jsonl", out, "--seed=7", *shard),
                    env=env).stderr.strip().splitlines()[-1]
    assert message == (
        f"prepare.py: error: {out} holds a complete prepared dataset ({out / 'meta.json'}: "
        f"'gpt2' tokens of '{tmp_path / 'docs.jsonl'}', with other settings (seed 2357 then, 7 "
        f"now)), which this sharded prepare would replace shard by shard, so that a stop "
        f"midway would leave neither dataset. Remove it first (rm -r {out}), or give another "
        f"--out_dir."), message
    assert read_all(out) == before
    p = prepare_shards(env, tmp_path / "docs.jsonl", out, *shard)
    assert "already holds this output, complete" in p.stdout and read_all(out) == before


def test_llmc_format_is_for_gpt2_tokens_only(env, tmp_path):
    """Its header says GPT-2: byte ids in it were trained as GPT-2 tokens."""
    write_corpus(tmp_path / "docs.jsonl", 100)
    message = fails("prepare.py", f"--dataset={tmp_path / 'docs.jsonl'}", "--format=llmc",
                    "--tokenizer=byte", f"--out_dir={tmp_path / 'out'}",
                    env=env).stderr.strip().splitlines()[-1]
    assert message.startswith("prepare.py: error: --format=llmc writes llm.c's GPT-2 shards, "
                              "whose header (magic 20240520) says the ids are GPT-2's") and \
        "'byte' ids (257 of them)" in message and "--format=raw" in message, message
    assert not (tmp_path / "out").exists()


def decoded_shards(out_dir):
    """Every document of both splits, decoded shard by shard: each holds whole documents."""
    tok = get_tokenizer("gpt2")
    docs = []
    for split in tokenfile.SPLITS:
        token_split = tokenfile.open_split(str(out_dir), split, block_size=1)
        for first, end in zip(token_split.starts[:-1], token_split.starts[1:]):
            tokens = tokenfile.read(token_split, np.array([first]), int(end - first))[0]
            assert tokens[-1] == tok.eot
            ends = np.flatnonzero(tokens == tok.eot)
            docs += [tok.decode(tokens[a:b].tolist())
                     for a, b in zip(np.concatenate([[0], ends[:-1] + 1]), ends)]
    return docs


def test_llmc_format_output_is_what_llmc_reads(env, tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", env["TIKTOKEN_CACHE_DIR"])
    write_corpus(tmp_path / "docs.jsonl", 3_000)
    out = tmp_path / "llmc"
    prepare_shards(env, tmp_path / "docs.jsonl", out, "--format=llmc", "--shard_tokens=100000")
    names = sorted(os.listdir(out))
    assert names[0].startswith("docs_train_000000.bin") and "docs_val_000000.bin" in names
    for name in names:
        if name.endswith(".bin"):  # llm.c's reader: the header, then exactly that many tokens
            header = np.fromfile(out / name, dtype="<i4", count=256)
            assert (header[0], header[1]) == (20240520, 1) and not header[3:].any()
            assert (out / name).stat().st_size == 1024 + 2 * header[2]
    # and without meta.json, as llm.c shards downloaded elsewhere come, training reads them
    (out / tokenfile.META_NAME).unlink()
    assert tokenfile.read_meta(str(out))["format"] == "llmc" and len(decoded_shards(out)) == 3_000


@pytest.mark.slow
def test_streaming_local_parquet_gives_the_same_tokens(env, tmp_path):
    rows = [f"document {i}: " + "streamed text " * (i % 7 + 1) for i in range(300)]
    for k in range(3):
        pq.write_table(pa.table({"text": rows[k * 100:(k + 1) * 100]}),
                       tmp_path / f"part-{k}.parquet")
    for name, extra in (("stored", []), ("streamed", ["--streaming"])):
        python("prepare.py", f"--dataset={tmp_path}/*.parquet", f"--out_dir={tmp_path / name}",
               "--tokenizer=byte", "--val_docs=10", "--num_proc=1", *extra, env=env)
    streamed = decoded(tmp_path / "streamed", get_tokenizer("byte"))
    assert streamed == decoded(tmp_path / "stored", get_tokenizer("byte"))
    assert sorted(streamed["train"] + streamed["val"]) == sorted(rows)


@pytest.mark.parametrize("files", ["*.md", "", "b.txt"], ids=["a glob of another kind",
                                                          "a folder of text", "a text file"])
def test_streaming_what_holds_no_parquet_says_so(files, env, tmp_path):
    """A glob of files prepare.py cannot read at all used to be a TypeError, reported as a
    dataset that 'could not be streamed'."""
    (tmp_path / "a.md").write_text("a note\n")
    (tmp_path / "b.txt").write_text("some text\n")
    dataset = str(tmp_path / files) if files else str(tmp_path)
    p = fails("prepare.py", f"--dataset={dataset}", "--streaming", "--tokenizer=byte",
              f"--out_dir={tmp_path / 'out'}", env=env)
    assert p.stderr.strip() == (
        f"prepare.py: error: --streaming reads local .parquet files only; --dataset="
        f"{dataset!r} has none: drop --streaming to read it."), p.stderr


# ---- bad shards: what train.py says ----

def bad_llmc(folder, case):
    shutil.copytree(folder, folder + "-" + case)
    folder = folder + "-" + case
    first = os.path.join(folder, "fineweb_train_000001.bin")
    tokens = np.fromfile(first, dtype="<u2")[512:]
    if case == "wrong magic":
        write_llmc_shard(first, tokens, magic=20240801, version=7)  # llama-3's uint32 shards
    elif case == "count disagrees":
        write_llmc_shard(first, tokens, count=len(tokens) + 5)
    elif case == "short file":
        with open(first, "wb") as f:
            f.write(b"\0" * 100)
    elif case == "no val shard":
        os.remove(os.path.join(folder, "fineweb_val_000000.bin"))
    return folder


@pytest.mark.parametrize("case, named", [
    ("wrong magic", ["fineweb_train_000001.bin", "magic 20240801, version 7", "llama-3"]),
    ("count disagrees", ["fineweb_train_000001.bin", "header says", "truncated"]),
    ("short file", ["fineweb_train_000001.bin", "100 bytes", "not a header and a whole"]),
    ("no val shard", ["none of the val split", "fineweb_val_000000.bin"]),
])
def test_bad_llmc_shards_are_named(case, named, env, llmc_data, tmp_path):
    folder = bad_llmc(llmc_data, case)
    err = fails("train.py", f"--data_dir={folder}", f"--out_dir={tmp_path / 'out'}", *TINY,
                "--max_iters=1", env=env).stderr
    assert all(n in err for n in named), err


@pytest.fixture(scope="module")
def prepared_byte_shards(tmp_path_factory, session_env):
    """A small corpus prepared with the byte tokenizer as shards of about 20,000 tokens."""
    root = tmp_path_factory.mktemp("byte_shards")
    write_corpus(root / "docs.jsonl", 300)
    out = root / "shards"
    python("prepare.py", f"--dataset={root / 'docs.jsonl'}", f"--out_dir={out}",
           "--tokenizer=byte", "--val_docs=20", "--num_proc=1", "--shard_tokens=20000",
           env=session_env)
    return out


@pytest.fixture
def byte_shards(prepared_byte_shards, tmp_path):
    """A copy of prepared_byte_shards, this test's own to spoil."""
    return Path(shutil.copytree(prepared_byte_shards, tmp_path / "shards"))


def unclear_folder(case, shards, llmc_data):
    """A folder as the hostile probe left it, and the block_size it trains with."""
    if case == "no meta.json":
        (shards / "meta.json").unlink()
    elif case == "a killed prepare's":
        (shards / "meta.json").unlink()
        (shards / "prepare.progress.json").write_text("{}")
    elif case == "a listed shard deleted":
        (shards / "train_000002.bin").unlink()
    elif case == "shards shorter than a block":
        return shards, 30000
    else:
        folder = Path(llmc_data)
        if case == "a stray train.bin":
            (folder / "train.bin").write_bytes(b"\0" * 1000)
        else:  # "two llm.c datasets"
            shutil.copy(folder / "fineweb_train_000002.bin",
                        folder / "tinystories_train_000001.bin")
        return folder, 32
    return shards, 32


@pytest.mark.parametrize("case, message", [
    ("no meta.json", "{d} holds shards (train_000000.bin and |more) but no meta.json, which "
                     "lists each split's shards in order"),
    ("a killed prepare's", "{d} holds an unfinished prepare: prepare.progress.json and the "
                           "shards it has published so far, but no meta.json"),
    ("a listed shard deleted", "{d}/train_000002.bin is listed in meta.json but does not "
                               "exist: it was deleted or moved"),
    ("shards shorter than a block", "and no window crosses from one shard into the next: "
                                    "prepare the data again with larger shards "
                                    "(--shard_tokens=30001 or more), or set block_size"),
    ("a stray train.bin", "{d} holds llm.c shards (fineweb_train_000001.bin and 3 more) and a "
                          "stray train.bin, but no val.bin"),
    ("two llm.c datasets", "{d} holds llm.c shards of 2 datasets (fineweb_*, tinystories_*), "
                           "which would be read as one train split"),
])
@pytest.mark.slow
def test_what_a_shard_folder_lacks_is_said(case, message, env, byte_shards, llmc_data, tmp_path):
    """Each said `train.bin does not exist`, advised a smaller block_size, raised
    FileNotFoundError, or read two datasets as one, while the folder told what was wrong."""
    folder, block_size = unclear_folder(case, byte_shards, llmc_data)
    err = fails("train.py", f"--data_dir={folder}", f"--out_dir={tmp_path / 'out'}", *TINY,
                f"--block_size={block_size}", "--max_iters=1", env=env).stderr
    assert all(part in err for part in message.format(d=folder).split("|")), err


@pytest.mark.slow
def test_a_gap_in_llmc_shard_numbers_is_noted_and_the_shards_counted(env, llmc_data, tmp_path):
    os.rename(os.path.join(llmc_data, "fineweb_train_000002.bin"),
              os.path.join(llmc_data, "fineweb_train_000004.bin"))
    p = python("train.py", f"--data_dir={llmc_data}", f"--out_dir={tmp_path / 'out'}", *TINY,
               "--max_iters=1", "--eval_iters=1", "--gradient_accumulation_steps=1", env=env)
    assert f"data: note: the llm.c train shards in {llmc_data} skip 1 number(s) (000002): " \
           f"read as they are, in name order." in p.stdout, p.stdout
    assert f"data: train: the 3 shards fineweb_train_000001.bin to fineweb_train_000004.bin " \
           f"in {llmc_data}, " in p.stdout
