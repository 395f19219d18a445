"""Fewer tokens to the same loss: val loss against tokens for the four combinations of arch
(gpt2, modern) and optimizer (adamw, muon), each a train.py run as a user runs it, with the same
data, model size, batches and schedule (only those two keys differ), on two corpora: the quick
start's (the standard library's Python, byte by byte) and the same text in GPT-2's tokens; and
for each, the tokens it takes to reach gpt2+adamw's final val loss. On a CPU in float32 every
run is deterministic, so these curves are the same on any machine, loaded or not.

Then the step's speed, which depends on the machine and its load: train.py's step for each
combination alone on the machine, benchmarks/minimal_loop.py's on the same configuration (the
ceiling), and nanoGPT's own train.py on the same configuration and data when NANOGPT_DIR names
a checkout of it (github.com/karpathy/nanoGPT), in rounds that take turns.

RECIPE_SEEDS=N runs only the first N seeds of each corpus (the results record which ran): a
quicker run, for a machine that cannot spare the whole part's half hour."""
import concurrent.futures
import json
import os
import pickle
import re
import statistics
import sys

from benchmarks import common
from benchmarks.preparing import tiktoken_env
from ddpgpt import runtime, tokenfile
from ddpgpt.arch import model_args

TITLE = "Recipe"
# (arch, optimizer, piece): the four combinations of the two keys, then recipe two's pieces
# (PIECES), each alone on modern+muon, and all of them together
PIECES = {"polar": ["--muon_coefficients=polar_express"], "normuon": ["--muon_beta2=0.95"],
          "cautious": ["--cautious_weight_decay=True"], "zero": ["--proj_init=zero"],
          "ema": ["--ema_tail=0.2"],
          # AdamW's peak and floor 5 times the quick start's: Muon's schedule, in proportion to
          # them, is unchanged
          "adamw5": ["--learning_rate=1e-2", "--min_lr=1e-3"]}
ALL = "+".join(PIECES)
# those that paid, which the modern configs take: the targets' combination
KEPT = "normuon+zero+adamw5"
COMBOS = [("gpt2", "adamw", ""), ("gpt2", "muon", ""), ("modern", "adamw", ""),
          ("modern", "muon", ""), *(("modern", "muon", piece) for piece in PIECES),
          ("modern", "muon", ALL), ("modern", "muon", KEPT)]
# the combinations the targets compare: the four, and the kept pieces (the last)
TARGETED = [*COMBOS[:4], COMBOS[-1]]
BASELINE = "gpt2+adamw"
TARGETS = {"modern+muon": 0.4, "gpt2+muon": 0.7}  # at most this share of BASELINE's tokens
# recipe two's targets for its kept pieces, per corpus
TARGETS_TWO = {"pystdlib-bytes": 0.15, "pystdlib-gpt2": 0.20}
STEP_TARGET, CEILING_TARGET, STEP_TARGET_TWO = 0.10, 0.03, 0.15
MINIMAL = [COMBOS[0], COMBOS[3]]  # the combinations the ceiling is run for
TINY = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4",
        "--gradient_accumulation_steps=1", "--learning_rate=3e-3", "--min_lr=3e-4"]
# the quick start's model and batch, on a shorter run with a schedule of its own; on GPT-2's
# tokens, whose 50,304-row output layer makes a token cost 8 times more, half the batch
QUICK = ["config/quickstart.py", "--max_iters=200", "--lr_decay_iters=200", "--warmup_iters=20",
         "--eval_interval=20", "--eval_iters=10"]
QUICK_GPT2 = ["config/quickstart.py", "--batch_size=8", "--max_iters=120",
              "--lr_decay_iters=120", "--warmup_iters=12", "--eval_interval=20", "--eval_iters=10"]
SPECS = {
    "full": dict(corpora={"pystdlib-bytes": dict(tokenizer="byte", args=QUICK,
                                                 seeds=(1337, 1338, 1339)),
                          "pystdlib-gpt2": dict(tokenizer="gpt2", args=QUICK_GPT2,
                                                seeds=(1337, 1338))},
                 combos=COMBOS,
                 speed=dict(args=["config/quickstart.py"], steps=20, warmup=5, rounds=5,
                            combos=TARGETED)),
    "small": dict(corpora={"pystdlib-bytes": dict(tokenizer="byte", seeds=(1,), args=[
                               *TINY, "--max_iters=6", "--lr_decay_iters=6", "--warmup_iters=1",
                               "--eval_interval=2", "--eval_iters=2"]),
                           "pystdlib-gpt2": dict(tokenizer="gpt2", seeds=(1,), args=[
                               *TINY, "--max_iters=4", "--lr_decay_iters=4", "--warmup_iters=1",
                               "--eval_interval=2", "--eval_iters=2"])},
                  # the targets' combinations but modern+adamw, which no target reads: that
                  # the optimizer leaves a run's start alone, gpt2's pair shows
                  combos=[COMBOS[0], COMBOS[1], COMBOS[3], COMBOS[-1]],
                  # train.py timed for the two combinations the targets compare only
                  speed=dict(args=TINY, steps=4, warmup=1, rounds=1, combos=MINIMAL))}
SMALL_DOCS = ("argparse", "shutil", "textwrap")  # the small mode's corpus: three modules
NANOGPT_KEYS = ("batch_size", "block_size", "gradient_accumulation_steps", "n_layer", "n_head",
                "n_embd", "dropout", "bias", "learning_rate", "weight_decay", "beta1", "beta2",
                "grad_clip", "decay_lr", "warmup_iters", "lr_decay_iters", "min_lr", "device",
                "dtype", "compile")
NANOGPT_STEP = re.compile(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms", re.M)
NO_NANOGPT = "not run: set NANOGPT_DIR to a checkout of github.com/karpathy/nanoGPT"
TIME_CAP_S = 3600  # only stops a hung run
TABLES = {
    "reach": [("corpus", "{corpus}"), ("combination", "{combo}"), ("seeds", "{seeds}"),
              ("final val loss", "{final_text}"),
              (f"tokens to {BASELINE}'s final val loss", "{tokens_text}"),
              (f"share of {BASELINE}'s tokens", "{ratio_text}")],
    "speed": [("loop", "{loop}"), ("combination", "{combo}"), ("rounds", "{rounds}"),
              ("tokens/step", "{tokens_per_step:,}"), ("ms/step (median)", "{ms_per_step:,.1f}"),
              ("tok/s", "{tok_per_s:,.0f}"), ("vs gpt2+adamw's train.py", "{versus:+.1%}"),
              ("load", "{load_1m}")],
    "commands": [("run", "{what}"), ("command", "`{command}`")]}


def name(arch, optimizer, piece=""):
    return f"{arch}+{optimizer}" + (f"+{piece}" if piece else "")


def piece_args(piece):
    return [a for p in piece.split("+") if p for a in PIECES[p]]


# ---- the data ----

def make_data(small, tokenizer, workdir, env):
    """The standard library's Python in `tokenizer`'s tokens, as prepare.py writes it: all of
    it (the quick start's corpus), or three modules in the small mode."""
    folder = os.path.join(workdir, f"data-{tokenizer}")
    source = ["--dataset=pystdlib", "--val_fraction=0.02"]
    if small:
        docs = os.path.join(workdir, "docs")
        os.makedirs(docs, exist_ok=True)
        for module in SMALL_DOCS:
            with open(os.path.join(os.path.dirname(os.__file__), f"{module}.py")) as f, \
                    open(os.path.join(docs, f"{module}.txt"), "w") as out:
                out.write(f.read())
        source = [f"--dataset={docs}", "--val_docs=1"]
    common.check(common.run_watched(
        [sys.executable, "prepare.py", *source, f"--tokenizer={tokenizer}", f"--out_dir={folder}"],
        env, TIME_CAP_S), f"prepare.py ({tokenizer})")
    return folder


# ---- sample efficiency ----

def train_command(args, combo, seed, data_dir, out_dir):
    arch, optimizer, piece = combo
    return ["train.py", *args, f"--arch={arch}", f"--optimizer={optimizer}", *piece_args(piece),
            f"--seed={seed}",
            f"--data_dir={data_dir}", f"--out_dir={out_dir}", "--log_interval=1000",
            "--keep_checkpoints=1", "--wandb_log=False"]


def evaluations(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [row for row in map(json.loads, f) if "val_loss" in row]


def curve_run(job):
    """One train.py run: its val loss at every evaluation, against the tokens trained on."""
    corpus, spec, combo, seed, data_dir, out_dir, env = job
    print(f"bench recipe: {corpus}, {name(*combo)}, seed {seed}", file=sys.stderr, flush=True)
    command = train_command(spec["args"], combo, seed, data_dir, out_dir)
    common.check(common.run_watched([sys.executable, *command], env, TIME_CAP_S),
                 f"train.py ({corpus}, {name(*combo)}, seed {seed})")
    cfg = common.train_config(spec["args"])
    tokens = cfg.global_batch * cfg.block_size
    curve = [[row["iter"] * tokens, row["val_loss"]] for row in evaluations(out_dir)]
    return {"corpus": corpus, "arch": combo[0], "optimizer": combo[1], "piece": combo[2],
            "combo": name(*combo), "seed": seed, "status": "ok",
            "tokens_per_step": tokens, "steps": cfg.max_iters, "curve": curve,
            "final_val_loss": curve[-1][1]}


def tokens_to_reach(curve, target):
    """The tokens at which a val-loss curve first reaches target, linear between evaluations;
    None if it never does."""
    for (t0, a), (t1, b) in zip([curve[0]] + curve, curve):
        if b <= target:
            return t1 if b == a else t0 + (t1 - t0) * (a - target) / (a - b)
    return None


def reach(rows):
    """Per corpus and combination, over its seeds: the final val loss, and the tokens it took
    to reach the BASELINE's final val loss of the same seed, as a share of the BASELINE's."""
    runs = {(r["corpus"], r["combo"], r["seed"]): r for r in rows}
    out = []
    for corpus in dict.fromkeys(r["corpus"] for r in rows):
        seeds = sorted({r["seed"] for r in rows if r["corpus"] == corpus})
        for combo in dict.fromkeys(r["combo"] for r in rows):
            finals, tokens, ratios = [], [], []
            for seed in seeds:
                base, run = runs[corpus, BASELINE, seed], runs[corpus, combo, seed]
                total = base["steps"] * base["tokens_per_step"]
                reached = tokens_to_reach(run["curve"], base["final_val_loss"])
                finals.append(run["final_val_loss"])
                tokens.append(reached)
                ratios.append(None if reached is None else reached / total)
            out.append({"corpus": corpus, "combo": combo, "seeds": len(seeds),
                        "finals": finals, "final_text": spread(finals, "{:.4f}"),
                        "tokens": tokens, "ratios": ratios,
                        "tokens_text": spread(tokens, "{:,.0f}"),
                        "ratio_text": spread(ratios, "{:.2f}x")})
    return out


def spread(values, fmt):
    """The mean of the values and their range; 'not reached' for those that are None."""
    reached = [v for v in values if v is not None]
    if not reached:
        return "not reached"
    text = fmt.format(statistics.fmean(reached))
    if len(values) > 1:
        text += f" ({fmt.format(min(reached))} to {fmt.format(max(reached))})"
    if len(reached) < len(values):
        text += f"; not reached in {len(values) - len(reached)} of {len(values)} seeds"
    return text


# ---- the step's speed ----

def speed_train(spec, combo, data_dir, out_dir, env):
    """ms per step of train.py alone on the machine, after the warm-up steps."""
    args = [*spec["args"], f"--max_iters={spec['steps']}", "--eval_iters=1",
            f"--eval_interval={spec['steps']}"]
    command = train_command(args, combo, 1337, data_dir, out_dir)
    common.check(common.run_watched([sys.executable, *command], env, TIME_CAP_S),
                 f"train.py ({name(*combo)})")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        ms = [row["ms"] for row in map(json.loads, f) if "ms" in row]
    return statistics.median(ms[spec["warmup"]:])


def speed_minimal(spec, combo, data_dir, env):
    """ms per step of benchmarks/minimal_loop.py on the same configuration."""
    args = ["-m", "benchmarks.minimal_loop", *spec["args"], f"--arch={combo[0]}",
            f"--optimizer={combo[1]}", *piece_args(combo[2]), f"--data_dir={data_dir}",
            f"--max_iters={spec['steps']}"]
    finished = common.check(common.run_watched([sys.executable, *args], env, TIME_CAP_S),
                            f"benchmarks/minimal_loop.py ({name(*combo)})")
    times = next(json.loads(line) for line in reversed(finished.output.splitlines())
                 if line.startswith('{"ms"'))
    return statistics.median(times["ms"][spec["warmup"]:])


def nanogpt_data(data_dir, workdir, vocab_size):
    """nanoGPT's layout of the same token files: train.bin and val.bin, and a meta.pkl whose
    vocab_size is the one train.py pads the data's to, so that both build the same model."""
    folder = os.path.join(workdir, "nanogpt-data")
    if not os.path.exists(folder):
        os.makedirs(folder)
        for split in ("train.bin", "val.bin"):
            os.symlink(os.path.join(data_dir, split), os.path.join(folder, split))
        with open(os.path.join(folder, "meta.pkl"), "wb") as f:
            pickle.dump({"vocab_size": vocab_size}, f)
    return folder


def nanogpt_command(cfg, steps, data, out_dir):
    """nanoGPT's train.py with train.py's configuration (its device and dtype as train.py
    resolves 'auto'); its evaluation only at iter 0."""
    device = runtime.pick_device(cfg.device, runtime.Ranks(0, 0, 1, 1))
    resolved = {"device": device, "dtype": runtime.precision(cfg.dtype, device).dtype}
    return ["train.py", *(f"--{k}={resolved.get(k, getattr(cfg, k))!r}" for k in NANOGPT_KEYS),
            f"--dataset={data}", f"--out_dir={out_dir}", f"--max_iters={steps}",
            f"--eval_interval={steps + 1}", "--eval_iters=1", "--log_interval=1",
            "--always_save_checkpoint=False", "--wandb_log=False"]


def speed_nanogpt(spec, cfg, data_dir, workdir, env):
    """ms per step of nanoGPT's train.py (the 'time' of its log lines), or None without it."""
    checkout = os.environ.get("NANOGPT_DIR")
    if not checkout:
        return None
    vocab_size = model_args(cfg, tokenfile.read_meta(data_dir))["vocab_size"]
    data = nanogpt_data(data_dir, workdir, vocab_size)
    command = nanogpt_command(cfg, spec["steps"], data, os.path.join(workdir, "out-nanogpt"))
    finished = common.check(common.run_watched([sys.executable, *command], env, TIME_CAP_S,
                                               cwd=checkout), "nanoGPT's train.py")
    ms = [float(t) for i, t in NANOGPT_STEP.findall(finished.output) if int(i) >= spec["warmup"]]
    return statistics.median(ms)


def speed(spec, data_dir, workdir, env):
    """The speed rows: each loop and combination, alone, in rounds that take turns, so that a
    change in the machine's load falls on all of them alike; each the median of its rounds."""
    cfg = common.train_config(spec["args"])
    tokens = cfg.global_batch * cfg.block_size
    loops = [("train.py", c) for c in spec["combos"]] + \
        [("minimal loop", c) for c in MINIMAL] + [("nanoGPT", COMBOS[0])]
    times, loads = {loop: [] for loop in loops}, {loop: [] for loop in loops}
    for i in range(spec["rounds"]):
        for loop, combo in loops:
            print(f"bench recipe: speed, round {i + 1}: {loop}, {name(*combo)}", file=sys.stderr,
                  flush=True)
            out = os.path.join(workdir, f"speed-{i}-{loop.replace(' ', '-')}-{name(*combo)}")
            ms = (speed_train(spec, combo, data_dir, out, env) if loop == "train.py" else
                  speed_minimal(spec, combo, data_dir, env) if loop == "minimal loop" else
                  speed_nanogpt(spec, cfg, data_dir, workdir, env))
            if ms is not None:
                times[loop, combo].append(ms)
                loads[loop, combo].append(common.load_1m())
    base = statistics.median(times["train.py", COMBOS[0]])
    rows = []
    for loop, combo in loops:
        row = {"loop": loop, "combo": name(*combo), "arch": combo[0], "optimizer": combo[1],
               "piece": combo[2]}
        if not times[loop, combo]:
            rows.append({**row, "status": NO_NANOGPT})
            continue
        ms = statistics.median(times[loop, combo])
        rows.append({**row, "status": "ok", "rounds": len(times[loop, combo]),
                     "round_ms": times[loop, combo], "tokens_per_step": tokens,
                     "ms_per_step": ms, "tok_per_s": tokens / ms * 1000, "versus": ms / base - 1,
                     "load_1m": max(loads[loop, combo])})
    return rows


# ---- the part ----

def commands(spec_args, speed_args):
    """The runs as a user types them (<data> and <out>: the run's folders)."""
    rows = [{"what": f"{corpus}, each combination and seed",
             "command": " ".join(["OMP_NUM_THREADS=1 python", *train_command(
                 spec["args"], ("<arch>", "<optimizer>", ""), "<seed>", "<data>", "<out>"),
                 "<the piece's keys>"])}
            for corpus, spec in spec_args.items()]
    speed_cmd = [*speed_args["args"], f"--max_iters={speed_args['steps']}"]
    return rows + [
        {"what": "speed: train.py", "command": " ".join(
            ["OMP_NUM_THREADS=1 python", *train_command(
                [*speed_cmd, "--eval_iters=1", f"--eval_interval={speed_args['steps']}"],
                ("<arch>", "<optimizer>", ""), 1337, "<data>", "<out>")])},
        {"what": "speed: the minimal loop", "command": " ".join(
            ["OMP_NUM_THREADS=1 python -m benchmarks.minimal_loop", *speed_cmd, "--arch=<arch>",
             "--optimizer=<optimizer>", "--data_dir=<data>"])},
        {"what": "speed: nanoGPT, in its checkout", "command": " ".join(
            ["OMP_NUM_THREADS=1 python", *nanogpt_command(
                common.train_config(speed_args["args"]), speed_args["steps"], "<data>",
                "<out>")])}]


def run(small, device, workdir):
    """device is not used: sample efficiency does not depend on it, and the speed rows are the
    CPU's (bench.py gpu times the GPU)."""
    spec = SPECS["small" if small else "full"]
    if os.environ.get("RECIPE_SEEDS"):
        n = int(os.environ["RECIPE_SEEDS"])
        spec = {**spec, "corpora": {k: {**c, "seeds": c["seeds"][:n]}
                                    for k, c in spec["corpora"].items()}}
    extra, vocab_note = tiktoken_env(workdir)
    env = common.child_env(OMP_NUM_THREADS="1", **extra)  # a thread a run: benchmarks/training.py
    data = {corpus: make_data(small, c["tokenizer"], workdir, env)
            for corpus, c in spec["corpora"].items()}
    jobs = [(corpus, c, combo, seed, data[corpus],
             os.path.join(workdir, f"out-{corpus}-{name(*combo)}-{seed}"), env)
            for corpus, c in spec["corpora"].items() for seed in c["seeds"]
            for combo in spec["combos"]]
    # the runs are deterministic, so they may share the cores: one run per core at a time
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        rows = list(pool.map(curve_run, jobs))
    reached = reach(rows)
    speed_rows = speed(spec["speed"], data["pystdlib-bytes"], workdir, env)
    settings = {"vocabulary": vocab_note, "baseline": BASELINE,
                "corpora": {k: {"args": " ".join(c["args"]), "seeds": list(c["seeds"])}
                            for k, c in spec["corpora"].items()},
                "speed_args": " ".join(spec["speed"]["args"]),
                "speed_steps": spec["speed"]["steps"], "speed_warmup": spec["speed"]["warmup"],
                "contributions": contributions(reached)}
    return {"settings": settings, "results": rows, "reach": reached, "speed": speed_rows,
            "commands": commands(spec["corpora"], spec["speed"]),
            "targets": targets(reached, speed_rows)}


def contributions(reached):
    """What each piece contributes, in words: the share of the baseline's tokens that Muon
    alone, the modern block alone, both, and recipe two's pieces need, per corpus."""
    corpora = dict.fromkeys(r["corpus"] for r in reached)
    return "; ".join(f"{corpus}: " + ", ".join(
        f"{r['combo']} {r['ratio_text']}" for r in reached
        if r["corpus"] == corpus and r["combo"] != BASELINE) for corpus in corpora)


def targets(reached, speed_rows):
    rows = {(r["corpus"], r["combo"]): r for r in reached}
    corpora = list(dict.fromkeys(r["corpus"] for r in reached))
    out = []
    for combo, share in TARGETS.items():
        ratios = [rows[c, combo]["ratios"] for c in corpora]
        out.append({"target": f"{combo} reaches {BASELINE}'s final val loss in at most "
                              f"{share}x its tokens, on every corpus and seed",
                    "measured": "; ".join(f"{c}: {rows[c, combo]['ratio_text']}"
                                          for c in corpora),
                    "met": all(r is not None and r <= share for rs in ratios for r in rs)})
    timed = {(r["loop"], r["combo"]): r for r in speed_rows}
    out.append(common.step_time_target(
        f"modern+muon's train.py step within {STEP_TARGET:.0%} of gpt2+adamw's (quick-start "
        f"model, CPU, one thread)", timed["train.py", "modern+muon"],
        timed["train.py", BASELINE], STEP_TARGET))
    out.append(common.step_time_target(
        f"train.py's gpt2+adamw step within {CEILING_TARGET:.0%} of benchmarks/minimal_loop.py's "
        f"(quick-start model, CPU, one thread)", timed["train.py", BASELINE],
        timed["minimal loop", BASELINE], CEILING_TARGET))
    out.append(common.step_time_target(
        "train.py's gpt2+adamw tokens/s no lower than nanoGPT's train.py's (quick-start model "
        "and data, CPU, one thread)", timed["train.py", BASELINE], timed["nanoGPT", BASELINE],
        0.0))
    every = name("modern", "muon", KEPT)
    for corpus, share in TARGETS_TWO.items():
        if (corpus, every) in rows:
            ratios = rows[corpus, every]["ratios"]
            out.append({"target": f"{every} (recipe two) reaches {BASELINE}'s final val loss "
                                  f"in at most {share}x its tokens on {corpus}, on every seed",
                        "measured": rows[corpus, every]["ratio_text"],
                        "met": all(r is not None and r <= share for r in ratios)})
    if ("train.py", every) in timed:
        out.append(common.step_time_target(
            f"{every}'s train.py step within {STEP_TARGET_TWO:.0%} of modern+muon's "
            f"(quick-start model, CPU, one thread)", timed["train.py", every],
            timed["train.py", "modern+muon"], STEP_TARGET_TWO))
    return out


def plot(result):
    """Val loss against tokens, a panel per corpus (the mean over seeds, their range shaded,
    the baseline's final val loss dashed), and the step's speed."""
    from matplotlib.figure import Figure

    corpora = list(dict.fromkeys(r["corpus"] for r in result["results"]))
    fig = Figure(figsize=(5 * (len(corpora) + 1), 4.5), layout="constrained")
    axes = fig.subplots(1, len(corpora) + 1)
    for ax, corpus in zip(axes, corpora):
        combos = dict.fromkeys(r["combo"] for r in result["results"] if r["corpus"] == corpus)
        for i, combo in enumerate(combos):
            runs = [r for r in result["results"]
                    if r["corpus"] == corpus and r["combo"] == combo]
            tokens = [t for t, _ in runs[0]["curve"]]
            losses = [[loss for _, loss in r["curve"]] for r in runs]
            mean = [statistics.fmean(v) for v in zip(*losses)]
            ax.plot([t / 1e6 for t in tokens], mean, color=f"C{i}", marker="o", markersize=3,
                    label=f"{combo} ({len(runs)} seed{'s' * (len(runs) > 1)})")
            if len(runs) > 1:
                ax.fill_between([t / 1e6 for t in tokens], [min(v) for v in zip(*losses)],
                                [max(v) for v in zip(*losses)], color=f"C{i}", alpha=0.2)
        base = [r["final_val_loss"] for r in result["results"]
                if r["corpus"] == corpus and r["combo"] == BASELINE]
        ax.axhline(statistics.fmean(base), color="k", linestyle="--", linewidth=0.8,
                   label=f"{BASELINE}'s final")
        finals = [r["final_val_loss"] for r in result["results"] if r["corpus"] == corpus]
        ax.set_ylim(min(finals) - 0.1, max(finals) + 1.0)  # the part where they differ
        ax.set(xlabel="tokens trained on (millions)", ylabel="val loss", title=corpus)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    done = [r for r in result["speed"] if r["status"] == "ok"]
    right = axes[-1]
    right.barh([f"{r['loop']}\n{r['combo']}" for r in done], [r["ms_per_step"] for r in done],
               color=["C0" if r["loop"] == "train.py" else "C7" for r in done])
    right.invert_yaxis()
    right.set(xlabel="ms per step (median)", title="the step (quick-start model, CPU)")
    right.tick_params(axis="y", labelsize=8)
    right.grid(axis="x", alpha=0.3)
    fig.suptitle("Sample efficiency: arch and optimizer (train.py, metrics.jsonl)")
    return fig
