"""prepare.py with a Hugging Face fast tokenizer: GPT-2's vocabulary as one (the folder
hf.save_gpt2_tokenizer writes, as export.py does), so that the same corpus gives the same
tokens as with tiktoken. Its worker processes, each encoding a chunk of documents as one batch
on one thread, against the tokenizer's own batch encoding on its threads in one process,
encoding alone (prepare_hf_ceiling.py): which way of spreading the work over the cores
prepare.py should take. prepare.py with tiktoken beside them. preparing.py's functions."""
from bench import preparing

TITLE = "Prepare with a Hugging Face tokenizer"
# pystdlib's first documents, x1 and x3: the memory's flatness in the corpus size, and what a
# loaded 2-core machine measures in minutes
FULL = {"copies": [1, 3], "documents": 300, "shard_tokens": 1_000_000}
SMALL = {"copies": [1, 2], "documents": 100, "shard_tokens": 200_000}
IMPLS = ("ddpgpt", "ddpgpt-hf", preparing.CEILING)  # as text/prepare_hf.md names them
TABLES = {"table": [row for row in preparing.TABLES["table"] if not row[0].startswith("ref")]}


def run(small, device, workdir):
    rows, settings = preparing.measure_all(SMALL if small else FULL, IMPLS, workdir)
    return {"settings": settings, "results": rows, "targets": targets(rows)}


def targets(rows):
    return [preparing.speed_target(rows, preparing.CEILING, lambda ratio: ratio >= 0.9,
                                   "prepare.py with a Hugging Face fast tokenizer at least 0.9x "
                                   "the tokens/s of the tokenizer's own batch encoding on its "
                                   "threads (encoding alone), at every corpus size",
                                   impl="ddpgpt-hf"),
            preparing.memory_target(rows, "ddpgpt-hf")]


def plot(result):
    return preparing.plot_titled(
        result, f"Prepare, GPT-2's vocabulary, tiktoken and Hugging Face's, "
                f"{result['settings']['processes']} cores")
