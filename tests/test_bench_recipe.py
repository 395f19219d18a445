"""bench.py's parts on the recipe's keys in their small mode (tests/test_bench.py: what every
part's run must show): recipe, muon, recompute."""
import pytest

from benchmarks import recipe
from test_bench import bench_part


@pytest.mark.slow
def test_recipe(env, tmp_path):
    env.pop("NANOGPT_DIR", None)  # nanoGPT's row: not run, and said so
    result, page = bench_part("recipe", env, tmp_path)
    runs = {(r["corpus"], r["combo"], r["seed"]): r for r in result["results"]}
    # the targets' combinations; modern+adamw, which none reads, only in the full mode
    combos = {"gpt2+adamw", "gpt2+muon", "modern+muon", f"modern+muon+{recipe.KEPT}"}
    assert set(runs) == {(corpus, combo, seed) for combo in combos
                         for corpus, c in result["settings"]["corpora"].items()
                         for seed in c["seeds"]}
    for r in runs.values():
        tokens = [t for t, _ in r["curve"]]
        assert tokens[0] == 0 and tokens[-1] == r["steps"] * r["tokens_per_step"]
        assert all(loss > 0 for _, loss in r["curve"]) and r["final_val_loss"] == r["curve"][-1][1]
    for corpus in result["settings"]["corpora"]:
        # the same data and the same first batch's loss for the same arch and seed: only the
        # optimizer differs, and it has not stepped yet at iter 0 (recipe two's zero
        # projections start another model)
        first = {runs[corpus, f"gpt2+{o}", 1]["curve"][0][1] for o in ("adamw", "muon")}
        assert len(first) == 1, first
    reach = {(r["corpus"], r["combo"]): r for r in result["reach"]}
    for (corpus, combo), r in reach.items():
        seeds = result["settings"]["corpora"][corpus]["seeds"]
        assert r["seeds"] == len(seeds) == len(r["ratios"])
        if combo == "gpt2+adamw":  # its own final loss is reached at its last evaluation
            assert r["ratios"] == [1.0] * len(seeds)
    speed = {(r["loop"], r["combo"]): r for r in result["speed"]}
    # the small mode times train.py for the two combinations the targets compare
    assert set(speed) == {(loop, c) for loop in ("train.py", "minimal loop")
                          for c in ("gpt2+adamw", "modern+muon")} | {("nanoGPT", "gpt2+adamw")}
    assert speed["nanoGPT", "gpt2+adamw"]["status"] == recipe.NO_NANOGPT
    for r in speed.values():
        assert r["status"] != "ok" or r["ms_per_step"] > 0 and r["tok_per_s"] > 0
    assert "| pystdlib-gpt2 | modern+muon | 1 |" in page and "| minimal loop | gpt2+adamw |" in page


def test_recipe_tokens_to_reach_a_loss():
    curve = [[0, 5.0], [100, 3.0], [200, 2.0], [300, 2.5]]
    reached = [recipe.tokens_to_reach(curve, loss) for loss in (2.5, 2.0, 6.0, 1.9)]
    assert reached == [150, 200, 0, None]


@pytest.mark.slow
def test_muon(env, tmp_path):
    result, page = bench_part("muon", env, tmp_path, timeout=1800)  # 6 launches of torchrun
    work = {(w["model"], w["ranks"]): w for w in result["work"]}
    for model in ("quick start (modern)", "GPT-2 124M"):
        # one rank does all of the work; N ranks about 1/N each, counted from the owners
        assert work[model, 1]["most"] == work[model, 1]["share"]
        for n in (2, 4, 8):
            assert work[model, n]["most"] == pytest.approx(work[model, 1]["most"] / n, rel=0.05)
    assert work["GPT-2 124M", 1]["matrices"] == 48  # 4 in each of the 12 blocks
    assert "| GPT-2 124M | 8 |" in page
    rows = {(r["parallel"], r["ranks"]): r for r in result["results"]}
    assert set(rows) == {("ddp", 1), ("ddp", 2), ("fsdp", 2)}
    # ddp: every byte on every rank; fsdp: half of them, Muon's momentum too, but for
    # AdamW's step counts, which every rank keeps whole
    assert rows["ddp", 1]["total"] == rows["ddp", 2]["total"]
    assert rows["fsdp", 2]["total"] == pytest.approx(rows["ddp", 2]["total"] / 2, rel=0.01)
    assert all(0 < r["optimizer_ms"] < r["step_ms"] for r in rows.values())
    assert [row["ranks"] for row in result["losses"]] == [2]
    assert result["losses"][0]["same_batches"]


@pytest.mark.slow
def test_recompute(env, tmp_path):
    result, page = bench_part("recompute", env, tmp_path)  # 4 processes of a tiny model
    rows = {r["mode"]: r for r in result["results"]}
    assert list(rows) == ["none", "selective", "full", "full, loss_chunks=8"]
    # the logits in chunks: fewer activations than full's in one piece (vocabulary 4096)
    assert rows["full, loss_chunks=8"]["activations"] < rows["full"]["activations"]
    assert rows["none"]["share"] == rows["none"]["slowdown"] == 1
    for r in rows.values():
        assert 0 < r["activations"] < r["total"] and r["step_s"] > 0
    assert "| full |" in page
