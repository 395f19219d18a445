"""bench.py's parts on the memory a run needs in their small mode (tests/test_bench.py: what
every part's run must show): fsdp against ddp, and the memory plan against measured runs."""
import re

import pytest

from test_bench import bench_part


@pytest.mark.slow
def test_fsdp(env, tmp_path):
    result, page = bench_part("fsdp", env, tmp_path, timeout=1800)  # 9 launches of torchrun
    rows = {(r["parallel"], r["ranks"]): r for r in result["results"]}
    ranks = result["settings"]["ranks"]  # 2 in the small mode; 2 and 4 in the full one
    assert set(rows) == {(kind, n) for kind in ("ddp", "fsdp") for n in ranks}
    for n in ranks:
        ddp, fsdp = rows["ddp", n], rows["fsdp", n]
        assert ddp["params"] == fsdp["params"] > 0
        # ddp: 4 + 4 + 8 bytes a parameter on every rank; fsdp: a 1/N share of them, but for
        # AdamW's step counts, which every rank keeps whole (4 bytes each)
        assert ddp["weights"] == ddp["grads"] == 4 * ddp["params"] and ddp["per_param"] > 16
        assert fsdp["total"] == pytest.approx(ddp["total"] / n, rel=0.01)
        assert fsdp["largest_whole"] == 4 and ddp["largest_whole"] > 4
        assert 0 < fsdp["peak_rss"] and 0 < ddp["peak_rss"]
    assert 16 <= result["settings"]["per_param"] < 16.1
    assert len(result["saves"]) == 4 and all(r["ratio"] > 0 for r in result["saves"])
    assert result["settings"]["same_checkpoints"] == {"ddp": True, "fsdp": True}
    losses = result["settings"]["losses"]
    assert losses["same_batches"] and losses["resumed_exact"] and losses["resumed_steps"] == 3
    fits = result["fits"]
    assert [f["params"] for f in fits] == sorted(f["params"] for f in fits)
    assert all(f["fsdp"] < f["fsdp_accumulating"] and f["fsdp"] < f["ddp"] for f in fits)
    assert fits[0]["params"] == 124_373_760  # GPT-2 124M: no biases, 50304 token ids
    assert [row["gpu"] for row in result["settings"]["largest"]] == ["8 x 24 GB", "8 x 40 GB",
                                                                    "8 x 80 GB"]
    assert "| 8 x 80 GB |" in page


@pytest.mark.slow
def test_memplan(env, tmp_path):
    result, page = bench_part("memplan", env, tmp_path)
    assert [(r["parallel"], r["ranks"]) for r in result["results"]] == [("ddp", 1)]
    assert all(r["planned"] > 0 and r["measured"] > 0 for r in result["results"])
    [tiny] = result["fits"]
    assert 0 < tiny["fsdp_one"] < tiny["ddp_one"]
    assert re.fullmatch(r"ddp, batch_size <= \d+; fsdp, batch_size <= \d+", tiny["gpu_24"])
    assert "| 8 x 24 GiB |" in page
