"""HellaSwag's throughput: eval.py run as a user runs it (python, or torchrun with gloo) on
HellaSwag-format examples made up here, with random weights of GPT-2 124M's shape (a tiny model
in the small mode): examples per second, from the seconds eval.py reports for the scoring
alone, and its counts, which must not change with the number of ranks."""
import json
import os
import sys

import numpy as np
import torch

from ddpgpt import checkpoint, hellaswag, tokenizer
from benchmarks import common
from benchmarks.preparing import tiktoken_env
from ddpgpt.model import GPT, GPTConfig

TITLE = "Evaluation"
SHAPES = {"GPT-2 124M": dict(n_layer=12, n_head=12, n_embd=768),
          "tiny": dict(n_layer=2, n_head=2, n_embd=64)}
# on a CPU, batches of 1 x 1024 tokens (their logits take 0.2 GiB in float32): several batches
# for each rank, so that the ranks' shares are even; small: a batch or two for each
CPU = ["--device=cpu", "--dtype=float32", "--batch_size=1"]
SMALL = [dict(name="tiny", ranks=ranks, examples=8, args=CPU) for ranks in (1, 2)]
FULL = [dict(name="GPT-2 124M", ranks=ranks, examples=32, args=CPU) for ranks in (1, 2)]
GPU = dict(name="GPT-2 124M", ranks=1, examples=10042, args=["--device=cuda"], gpu=True)
NO_GPU = "not run: no GPU in this session (run `python bench.py eval --device=cuda` on one)"
WORDS = ("the a man woman dog cat runs walks into house water ball slowly then picks up puts "
         "down and with on of to is are was were kitchen garden camera shows talking while "
         "people watch holding knife bread paint wall car road bike river mountain").split()
CONTEXT_WORDS, ENDING_WORDS = (15, 80), (5, 35)  # uniform ranges, in words
TIME_CAP_S = 1800  # only stops a hung run
TABLES = {
    "table": [("run", "{name}"), ("ranks", "{ranks}"), ("device", "{device}"),
              ("dtype", "{dtype}"), ("examples", "{examples:,}"),
              ("tokens/example", "{tokens_per_example:.0f}"), ("seconds", "{seconds:.1f}"),
              ("examples/s", "{examples_per_s:,.2f}"), ("acc_norm", "{acc_norm_right}"),
              ("acc", "{acc_right}"), ("load", "{load_1m}")],
    "commands": [("run", "{name}"), ("ranks", "{ranks}"), ("command", "`{command}`")]}


def write_examples(path, n):
    """n examples of HellaSwag's format from random words, the same for every run."""
    rng = np.random.default_rng(0)

    def text(lo, hi):
        return " ".join(rng.choice(WORDS, rng.integers(lo, hi + 1)))

    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"ctx": text(*CONTEXT_WORDS), "label": int(rng.integers(4)),
                                "endings": [text(*ENDING_WORDS) for _ in range(4)]}) + "\n")
    return path


def tokens_per_example(path):
    """The mean unpadded input tokens of an example's four rows, as eval.py renders them."""
    tok = tokenizer.get_tokenizer("gpt2")
    rows = [hellaswag.render(e, tok.encode, 1024)[0] for e in hellaswag.read(path)]
    return float(np.mean([sum(len(r) - 1 for r in four) for four in rows]))


def random_checkpoint(shape, folder):
    """A checkpoint of random weights in the shape, with GPT-2's vocabulary and positions."""
    torch.manual_seed(0)
    args = dict(block_size=1024, vocab_size=50304, bias=True, dropout=0.0, **SHAPES[shape])
    state = {"model": GPT(GPTConfig(**args)).state_dict(), "model_args": args, "iter_num": 0,
             "data_meta": {"tokenizer": "gpt2"}}
    os.makedirs(folder, exist_ok=True)
    return checkpoint.save(folder, state, keep=1)


def command(spec):
    launcher = "python" if spec["ranks"] == 1 else \
        f"torchrun --standalone --nproc_per_node={spec['ranks']}"
    return " ".join(["OMP_NUM_THREADS=1", launcher, "eval.py", "--out_dir=<checkpoint>",
                     "--hellaswag_path=<examples>", *spec["args"]])


def measure(spec, ckpt, examples, env):
    launcher = common.torchrun(spec["ranks"]) if spec["ranks"] > 1 else [sys.executable]
    print(f"bench eval: {spec['name']}, {spec['ranks']} rank(s)", file=sys.stderr)
    finished = common.check(common.run_watched(
        [*launcher, "eval.py", f"--out_dir={ckpt}", f"--hellaswag_path={examples}",
         *spec["args"]], env, TIME_CAP_S), f"eval.py ({spec['name']})")
    out = json.loads(next(line for line in reversed(finished.output.splitlines())
                          if line.startswith("{")))
    n, device = out["hellaswag_n"], spec["args"][0].removeprefix("--device=")
    return {"status": "ok", "device": device,
            "dtype": "float32" if device == "cpu" else "bfloat16", "seconds": out["hellaswag_s"],
            "examples_per_s": n / out["hellaswag_s"],
            "acc_norm_right": round(out["hellaswag_acc_norm"] * n),
            "acc_right": round(out["hellaswag_acc"] * n), "load_1m": common.load_1m()}


def run(small, device, workdir):
    extra, vocab_note = tiktoken_env(workdir)
    os.environ.update(extra)  # for tokens_per_example, here
    env = common.child_env(OMP_NUM_THREADS="1", **extra)
    rows, checkpoints, files = [], {}, {}
    for spec in (SMALL if small else FULL) + [GPU]:
        row = {k: spec[k] for k in ("name", "ranks", "examples")}
        row.update(gpu=spec.get("gpu", False), command=command(spec))
        if spec.get("gpu") and device != "cuda":
            rows.append({**row, "status": NO_GPU})
            continue
        name, n = spec["name"], spec["examples"]
        if name not in checkpoints:
            checkpoints[name] = random_checkpoint(
                name, os.path.join(workdir, f"checkpoint-{len(checkpoints)}"))
        if n not in files:
            files[n] = write_examples(os.path.join(workdir, f"hellaswag-{n}.jsonl"), n)
        rows.append({**row, "tokens_per_example": tokens_per_example(files[n]),
                     **measure(spec, checkpoints[name], files[n], env)})
    return {"settings": {"vocabulary": vocab_note, "context_words": CONTEXT_WORDS,
                         "ending_words": ENDING_WORDS}, "results": rows, "targets": targets(rows)}


def targets(rows):
    """The counts on 2 ranks equal those on 1; 2 ranks score faster than 1."""
    done = [r for r in rows if r["status"] == "ok"]
    pairs = [(one, two) for one in done for two in done
             if one["name"] == two["name"] and (one["ranks"], two["ranks"]) == (1, 2)]
    same = [f"{one['name']}: acc_norm {one['acc_norm_right']} and {two['acc_norm_right']}, acc "
            f"{one['acc_right']} and {two['acc_right']} of {one['examples']}"
            for one, two in pairs]
    speed = [f"{one['name']}: {one['examples_per_s']:.2f} and {two['examples_per_s']:.2f} "
             f"examples/s ({two['examples_per_s'] / one['examples_per_s']:.2f}x)"
             for one, two in pairs]
    return [{"target": "HellaSwag's counts on 2 ranks the same as on 1",
             "measured": "; ".join(same),
             "met": all((one["acc_norm_right"], one["acc_right"]) ==
                        (two["acc_norm_right"], two["acc_right"]) for one, two in pairs)},
            {"target": "2 ranks score HellaSwag faster than 1 (the examples are shared out, "
                       "not scored by rank 0 alone)", "measured": "; ".join(speed),
             "met": all(two["examples_per_s"] > one["examples_per_s"] for one, two in pairs)}]


def plot(result):
    from matplotlib.figure import Figure

    done = [r for r in result["results"] if r["status"] == "ok"]
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    ax.bar([f"{r['name']}\n{r['ranks']} rank(s), {r['device']}" for r in done],
           [r["examples_per_s"] for r in done], color="C0")
    ax.set(ylabel="HellaSwag examples/s")
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle("HellaSwag with eval.py (random weights)")
    fig.tight_layout()
    return fig
