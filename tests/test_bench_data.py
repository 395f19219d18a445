"""bench.py's data parts in their small mode, as CI runs them (tests/test_bench.py: what every
part's run must show): the data path and the mixtures; and the shard set the data part reads."""
import numpy as np
import pytest

from benchmarks import datapath, report
from ddpgpt import tokenfile
from test_bench import bench_part


@pytest.mark.slow
def test_data_path(env, tmp_path):
    result, page = bench_part("data", env, tmp_path)
    s = result["settings"]
    rows = {(r["size"], r["files"], r["ranks"], r["loader"]): r for r in result["results"]}
    assert len(rows) == len(result["results"])
    large, n_shards = max(s["sizes"]), s["shards"]
    assert set(rows) == {(size, 1, ranks, loader) for size in s["sizes"] for ranks in s["ranks"]
                         for loader in ("ddpgpt", "documents", "nanogpt", "seed")} | \
        {(large, n_shards, ranks, "ddpgpt") for ranks in s["ranks"]}
    for (size, files, ranks, loader), r in rows.items():
        if loader == "seed" and size == max(s["sizes"]):
            # a sample index per token, permuted in every rank: past a cap at 64 MiB (memory,
            # or time on a loaded machine, whichever it reaches first)
            assert r["status"].startswith(("exceeded the memory cap", "exceeded the time cap")), r
            continue
        assert r["status"] == "ok", r
        assert r["files_read"] == files  # the shard set was read as a shard set
        assert r["startup_s"] > r["setup_s"] > 0
        assert 0 < r["p50_ms"] <= r["p99_ms"] and r["batches_per_s"] > 0
        for when in ("first", "after"):
            assert 0 < r[f"private_{when}"] < r[f"rss_{when}"]
    assert "| 1 | 64 MiB | 1 | seed | exceeded the " in page
    assert "| 1 | 64 MiB | 1,000 | ddpgpt | " in page and "| 1 | 64 MiB | 1 | documents | " in page
    assert len(result["targets"]) == 15
    # the document index of a real token file: its documents, and every window of an epoch of
    # 'documents' mode at a start the bench found in the tokens itself, each start once
    index, = result["index"]
    assert index["size"] == s["index_size"] and index["windows"] > index["documents"] > 1000
    assert index["aligned"] == 1 and index["each_once"] and index["build_cpu_s"] > 0
    assert f"| {report.size(s['index_size'])} | {index['documents']:,} | " in page


@pytest.mark.slow
def test_mix(env, tmp_path):
    result, page = bench_part("mix", env, tmp_path)
    s = result["settings"]
    rows = {(r["sources"], r["ranks"]): r for r in result["results"]}
    assert len(rows) == len(result["results"]) == 2 * len(s["ranks"])
    assert set(rows) == {(n, k) for n in (1, s["sources"]) for k in s["ranks"]}
    assert s["sources"] == len(s["weights"]) == 8
    for (n, ranks), r in rows.items():
        assert r["status"] == "ok", r
        assert r["files_read"] == n and r["size"] == s["size"]  # every source was opened
        assert r["startup_s"] > r["setup_s"] > 0
        assert 0 < r["p50_ms"] <= r["p99_ms"] and r["batches_per_s"] > 0
    assert "| 2 | 8 | 8 | " in page
    assert len(result["targets"]) == 2


def test_shard_set_is_the_token_space_of_one_file(tmp_path):
    # the data part's shard set against its single file: as many tokens, in shards of sizes
    # that differ by one token at most, which the loader reads through meta.json
    size, n_shards = 2 * 7003, 7
    one = datapath.sparse_token_file(str(tmp_path / "one"), size)
    many = datapath.sparse_shard_set(str(tmp_path / "many"), size, n_shards)
    single, shards = (tokenfile.open_split(d, "train", 16) for d in (one, many))
    assert single.n_tokens == shards.n_tokens == size // 2 and len(shards.paths) == n_shards
    assert set(np.diff(shards.starts).tolist()) == {1000, 1001}
