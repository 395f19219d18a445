"""bench.py's parts on preparing and reading the data, and the quick start's training, in their
small mode (tests/test_bench.py: what every part's run must show): prepare, prepare_hf, documents,
training."""
import numpy as np
import pytest

from test_bench import bench_part


@pytest.mark.slow
def test_training(env, tmp_path):
    result, page = bench_part("training", env, tmp_path)
    quick, gpu = result["results"]
    assert quick["status"] == "ok" and quick["device"] == "cpu"
    assert quick["steps_counted"] == quick["steps"] - quick["warmup"]
    assert quick["ms_per_step"] > 0 and quick["tok_per_s"] > 0 and quick["tflops"] > 0
    assert 0 <= quick["data_wait"] <= quick["data_wait_max"] < 1
    assert quick["mfu"] is None  # a CPU has no known peak
    assert gpu["status"].startswith("not run: no GPU")
    assert f"`{quick['command']}`" in page
    # the quick-start run's curves, by plot.py, on the page
    assert (tmp_path / "bench" / "training-curves.png").stat().st_size > 0
    assert "![Training: the runs' curves](training-curves.png)" in page


@pytest.mark.slow
def test_prepare(env, tmp_path):
    result, _ = bench_part("prepare", env, tmp_path)
    rows = {(r["copies"], r["impl"]): r for r in result["results"]}
    copies, shard_tokens = result["settings"]["copies"], result["settings"]["shard_tokens"]
    impls = ("ddpgpt", "reference", "llmc")
    assert set(rows) == {(c, impl) for c in copies for impl in impls}
    for c in copies:
        # the same documents through the same tokenizer: the same number of tokens
        tokens = rows[c, "ddpgpt"]["tokens"]
        assert tokens == rows[c, "reference"]["tokens"] == rows[c, "llmc"]["tokens"] > 0
        assert tokens == c * rows[copies[0], "ddpgpt"]["tokens"]
        for impl in impls:
            r = rows[c, impl]
            assert r["tok_per_s"] > 0 and r["peak_rss"] > 0
            # the CPU time of the command and its workers, which no more cores can exceed
            assert 0 < r["cpu_s"] <= r["wall_s"] * result["machine"]["cores"] + 0.5
        # shards: llm.c's fill each one to shard_tokens; prepare.py's end at a document's end
        assert rows[c, "llmc"]["files"] == -(-tokens // shard_tokens) >= 2
        assert rows[c, "ddpgpt"]["files"] > 2 and rows[c, "reference"]["files"] == 2
    phases = {"documents", "load_s", "tokenize_s", "write_s"}
    assert set(rows[copies[0], "reference"]["phases"]) == phases
    assert set(rows[copies[0], "llmc"]["phases"]) == phases | {"shards"}


@pytest.mark.slow
def test_prepare_hf(env, tmp_path):
    result, _ = bench_part("prepare_hf", env, tmp_path)
    rows = {(r["copies"], r["impl"]): r for r in result["results"]}
    copies = result["settings"]["copies"]
    assert set(rows) == {(c, impl) for c in copies for impl in ("ddpgpt", "ddpgpt-hf",
                                                                 "hf-threads")}
    for c in copies:
        # GPT-2's vocabulary, tiktoken's and Hugging Face's: the same tokens, the same shards
        assert rows[c, "ddpgpt"]["tokens"] == rows[c, "ddpgpt-hf"]["tokens"] == \
            rows[c, "hf-threads"]["tokens"] == c * rows[copies[0], "ddpgpt"]["tokens"] > 0
        assert rows[c, "ddpgpt"]["files"] == rows[c, "ddpgpt-hf"]["files"] >= 2
        assert rows[c, "hf-threads"]["files"] == 0
        for r in (rows[c, impl] for impl in ("ddpgpt", "ddpgpt-hf", "hf-threads")):
            assert r["tok_per_s"] > 0 and r["peak_rss"] > 0
            assert 0 < r["cpu_s"] <= r["wall_s"] * result["machine"]["cores"] + 0.5


@pytest.mark.slow
def test_documents(env, tmp_path):
    result, page = bench_part("documents", env, tmp_path)
    runs = {(r["corpus"], r["mode"], r["seed"]): r for r in result["results"]}
    seeds = result["settings"]["seeds"]
    assert set(runs) == {(c, m, s) for c in ("quick start", "functions")
                         for m in ("epoch", "documents") for s in seeds}
    for r in runs.values():
        assert r["status"] == "ok" and r["steps"] == result["settings"]["steps"]
        assert all(np.isfinite(r[k]) and r[k] > 0 for k in ("train_loss", "val_loss",
                                                             "val_loss_docs"))
    for d in result["differences"]:  # documents' number less epoch's, at equal tokens
        epoch, docs = (runs[d["corpus"], mode, d["seed"]] for mode in ("epoch", "documents"))
        assert epoch["tokens"] == docs["tokens"] > 0
        assert d["val_loss_docs"] == docs["val_loss_docs"] - epoch["val_loss_docs"]
    corpora = {c["corpus"]: c for c in result["corpora"]}
    for c in corpora.values():  # every document starts a window; a long one, more
        assert c["windows"] >= c["documents"] > 1 and 0 < c["first_share"] <= 1
    assert corpora["functions"]["mean_length"] < corpora["quick start"]["mean_length"]
    assert "| quick start | documents | " in page and "val_loss_docs: documents - epoch" in page
