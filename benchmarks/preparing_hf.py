"""prepare.py with a Hugging Face fast tokenizer: GPT-2's vocabulary as one (the folder
hf.save_gpt2_tokenizer writes, as export.py does), so that the same corpus gives the same
tokens as with tiktoken. Its worker processes, each encoding a chunk of documents as one batch
on one thread, against the tokenizer's own batch encoding on its threads in one process,
encoding alone (prepare_hf_ceiling.py): which way of spreading the work over the cores
prepare.py should take. prepare.py with tiktoken beside them. preparing.py's functions."""
from benchmarks import preparing

TITLE = "Prepare with a Hugging Face tokenizer"
# pystdlib's first documents, x1 to x9: the memory's flatness in the corpus size, and prepare.py's
# rate once started, on the tokens x9 adds to x1
FULL = {"copies": [1, 3, 9], "documents": 300, "shard_tokens": 1_000_000}
SMALL = {"copies": [1, 2], "documents": 100, "shard_tokens": 200_000}
IMPLS = ("ddpgpt", "ddpgpt-hf", preparing.CEILING)  # as text/prepare_hf.md names them
TABLES = {"table": [row for row in preparing.TABLES["table"] if not row[0].startswith("ref")]}


def run(small, device, workdir):
    rows, settings = preparing.measure_all(SMALL if small else FULL, IMPLS, workdir)
    return {"settings": settings, "results": rows, "targets": targets(rows)}


def targets(rows):
    return [speed_target(rows), preparing.memory_target(rows, "ddpgpt-hf")]


def speed_target(rows):
    """prepare.py's tokens/s once started, on the tokens the largest corpus adds to the smallest
    (its start-up, mostly transformers' import, is the same at every size), against the
    ceiling's at the largest corpus, whose clock starts with the encoding; the whole runs'
    ratios beside it."""
    small, large = preparing.smallest_and_largest(rows, "ddpgpt-hf")
    ceiling = next(r for r in rows if r["impl"] == preparing.CEILING
                   and r["copies"] == large["copies"])
    whole = "; ".join(text for text, _ in preparing.compared(rows, preparing.CEILING,
                                                             "ddpgpt-hf"))
    target = (f"prepare.py with a Hugging Face fast tokenizer at least 0.9x the tokens/s of the "
              f"tokenizer's own batch encoding on its threads (encoding alone), once started: "
              f"on the tokens pystdlib x{large['copies']} adds to x{small['copies']}")
    added_s = large["wall_s"] - small["wall_s"]
    if added_s <= 0:  # corpora too small for this machine's noise (the small mode's)
        return {"target": target, "met": False, "measured": f"x{large['copies']} took no "
                f"longer than x{small['copies']}: no rate to judge; whole runs: {whole}"}
    rate = (large["tokens"] - small["tokens"]) / added_s
    start_s = small["wall_s"] - small["tokens"] / rate
    return {"target": target,
            "measured": f"{rate:,.0f} vs {ceiling['tok_per_s']:,.0f} tokens/s "
                        f"({rate / ceiling['tok_per_s']:.2f}x), after a start-up of "
                        f"{start_s:.1f} s; whole runs: {whole}",
            "met": rate >= 0.9 * ceiling["tok_per_s"]}


def plot(result):
    return preparing.plot_titled(
        result, f"Prepare, GPT-2's vocabulary, tiktoken and Hugging Face's, "
                f"{result['settings']['processes']} cores")
