"""sampling='documents' against 'epoch' at equal tokens: train.py trains the same model on the
same data from the same seed for the same steps in either mode, and the last evaluation's
val_loss (the fixed windows every run reports) and val_loss_docs (as many windows that start
where documents do) are set side by side. Two corpora: the quick start's (the standard
library's .py files in bytes, documents far longer than a block) and the standard library cut
into its top-level functions and classes, in GPT-2's tokens (documents about a block long, as
web text is in GPT-2's 1024). Not a timing: on a CPU in float32 each run repeats bit for bit,
whatever the machine's load."""
import itertools
import json
import os
import re
import sys

import numpy as np

from benchmarks import common, preparing
from ddpgpt import corpus, data, docindex, sources

TITLE = "Documents mode: val loss at equal tokens"
MODES = ("epoch", "documents")
TIME_CAP_S = 3600  # only stops a hung run
QUICKSTART = ["config/quickstart.py", "--log_interval=100"]  # its model, batch and optimizer
CORPORA = {  # name: (how its text is cut into documents, tokenizer, train.py's arguments)
    "quick start": ("modules", "byte", QUICKSTART),
    # GPT-2's 1024 positions, where these documents are about a block long, as web text is;
    # a narrower model and 2 x 1024 tokens a step, for the vocabulary's cost on a CPU
    "functions": ("functions", "gpt2", [*QUICKSTART, "--n_embd=64", "--block_size=1024",
                                        "--batch_size=2", "--gradient_accumulation_steps=1"]),
}
FULL = {"modules": None, "val_fraction": 0.02, "steps": 300, "eval_iters": 25,
        "seeds": [1337], "model": []}
SMALL = {"modules": 30, "val_fraction": 0.2, "steps": 2, "eval_iters": 1, "seeds": [1337],
         "model": ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=64"]}
TABLES = {
    "table": [("corpus", "{corpus}"), ("sampling", "{mode}"), ("seed", "{seed}"),
              ("steps", "{steps}"), ("tokens trained", "{tokens:,}"),
              ("train loss", "{train_loss:.4f}"), ("val_loss", "{val_loss:.4f}"),
              ("val_loss_docs", "{val_loss_docs:.4f}")],
    "corpora": [("corpus", "{corpus}"), ("documents are", "{cut}"), ("tokenizer", "{tokenizer}"),
                ("train tokens", "{tokens:,}"), ("train documents", "{documents:,}"),
                ("mean document", "{mean_length:,.0f} tokens"), ("block_size", "{block_size}"),
                ("windows per epoch (documents)", "{windows:,}"),
                ("of them at a document's first token", "{first_share:.1%}")],
    "commands": [("corpus", "{corpus}"), ("sampling", "{mode}"), ("command", "`{command}`")],
    "differences": [("corpus", "{corpus}"), ("seed", "{seed}"),
                    ("val_loss: documents - epoch", "{val_loss:+.4f}"),
                    ("val_loss_docs: documents - epoch", "{val_loss_docs:+.4f}")]}


def functions(text):
    """A module's top-level pieces: what comes before its first def or class, then each
    top-level def or class (with its decorators) up to the next."""
    return [piece for piece in re.split(r"\n(?=(?:def |class |async def |@)\S)", text)
            if piece.strip()]


def write_corpus(path, cut, modules):
    """The standard library's modules (the first `modules`, or all), as prepare.py
    --dataset=pystdlib reads them, a document per module or per function."""
    texts = (t for t in corpus.open_corpus("pystdlib", None, 1).documents()
             if t is not None and corpus.is_document(t))
    with open(path, "w", encoding="utf-8") as f:
        for text in itertools.islice(texts, modules):
            for document in functions(text) if cut == "functions" else [text]:
                f.write(json.dumps({"text": document}) + "\n")


def prepare(name, settings, workdir, env):
    """The corpus's data folder, made by prepare.py."""
    cut, tokenizer, _ = CORPORA[name]
    texts, folder = (os.path.join(workdir, f"{cut}.{ext}") for ext in ("jsonl", "data"))
    write_corpus(texts, cut, settings["modules"])
    common.check(common.run_watched(
        [sys.executable, "prepare.py", f"--dataset={texts}", f"--tokenizer={tokenizer}",
         f"--val_fraction={settings['val_fraction']}", f"--out_dir={folder}", "--num_proc=1"],
        env, TIME_CAP_S),
        f"prepare.py ({name})")
    return folder


def train(name, folder, mode, seed, settings, workdir, env):
    """The last evaluation of a run of train.py in this mode; one process, one thread."""
    out = os.path.join(workdir, f"out-{CORPORA[name][0]}-{mode}-{seed}")
    steps = settings["steps"]
    args = [*CORPORA[name][2], *settings["model"], f"--data_dir={folder}", f"--out_dir={out}",
            f"--seed={seed}",
            f"--sampling={mode}", f"--max_iters={steps}", f"--lr_decay_iters={steps}",
            f"--warmup_iters={max(1, steps // 20)}", f"--eval_interval={steps}",
            f"--eval_iters={settings['eval_iters']}", "--device=cpu",
            # TIME_CAP_S stops a hung run; train.py's watchdog would stop a run that is only
            # slow on a loaded machine (an evaluation of GPT-2's vocabulary can take minutes)
            "--hang_timeout_s=0", "--startup_timeout_s=0"]
    print(f"bench documents: {name}, {mode}, seed {seed}", file=sys.stderr)
    common.check(common.run_watched([sys.executable, "train.py", *args], env, TIME_CAP_S),
                 f"train.py ({name}, {mode})")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        last = [row for row in map(json.loads, f) if "val_loss" in row][-1]
    cfg = common.train_config(args)
    return {"corpus": name, "mode": mode, "seed": seed, "steps": last["iter"],
            "tokens": last["iter"] * cfg.global_batch * cfg.block_size,
            "block_size": cfg.block_size,
            **{k: last[k] for k in ("train_loss", "val_loss", "val_loss_docs")},
            "command": " ".join(["python", "train.py", *args]), "status": "ok"}


def describe(name, folder, block_size):
    """What documents mode does with the corpus's train split."""
    cut, tokenizer, _ = CORPORA[name]
    token_split = sources.open_split(folder, "train", block_size, mode="documents")
    windows = int(data.windows(data.mixture([token_split]), block_size, "documents").n[0])
    lengths, counts = docindex.doc_lengths(token_split.docs)
    return {"corpus": name, "cut": {"modules": "modules", "functions": "top-level functions "
                                    "and classes"}[cut], "tokenizer": tokenizer,
            "tokens": token_split.n_tokens, "documents": token_split.docs.documents,
            "mean_length": token_split.n_tokens / token_split.docs.documents,
            "block_size": block_size, "windows": windows,
            "first_share": int(counts[lengths >= 2].sum()) / windows}


def run(small, device, workdir):
    settings = SMALL if small else FULL
    extra, vocab_note = preparing.tiktoken_env(workdir)
    env = common.child_env(OMP_NUM_THREADS="1", **extra)
    rows, corpora, differences = [], [], []
    for name in CORPORA:
        folder = prepare(name, settings, workdir, env)
        runs = {(mode, seed): train(name, folder, mode, seed, settings, workdir, env)
                for seed in settings["seeds"] for mode in MODES}
        rows += runs.values()
        corpora.append(describe(name, folder, rows[-1]["block_size"]))
        differences += [{"corpus": name, "seed": seed, **{
            key: runs["documents", seed][key] - runs["epoch", seed][key]
            for key in ("val_loss", "val_loss_docs")}} for seed in settings["seeds"]]
    return {"settings": {**settings, "vocabulary": vocab_note}, "results": rows,
            "corpora": corpora, "differences": differences, "targets": []}


def plot(result):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4))
    axes = fig.subplots(1, 2)
    for ax, key in zip(axes, ("val_loss", "val_loss_docs")):
        names = list(dict.fromkeys(r["corpus"] for r in result["results"]))
        for k, mode in enumerate(MODES):
            values = [np.mean([r[key] for r in result["results"]
                               if r["corpus"] == name and r["mode"] == mode]) for name in names]
            ax.bar(np.arange(len(names)) + 0.4 * k, values, width=0.4, label=mode)
        ax.set_xticks(np.arange(len(names)) + 0.2, names)
        ax.set(ylabel=key)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(title="sampling")
    fig.suptitle("The last evaluation at equal tokens")
    fig.tight_layout()
    return fig
