"""Evaluate a model the way people report it: val loss and bits per byte on a data folder's val
split, and HellaSwag accuracy, on one process or many (docs/evaluation.md: what it loads, on
which data, and what it prints; ddpgpt/evaluation.py: what is measured, and how):

  python eval.py --out_dir=out-quickstart  # a run's newest checkpoint
  python eval.py --init_from=gpt2          # OpenAI's GPT-2 124M

A checkpoint is evaluated by default on the data it trained on, with its eval_iters, batch_size
and block_size, so that the val loss is the one train.py logged at its iter. Progress goes to
stderr; stdout gets a summary, then one JSON line of the numbers."""
import dataclasses
import json
import logging
import sys
import time

from ddpgpt import configurator, cpu
from ddpgpt.settings import EvalConfig

cpu.wait_passively()  # before torch is imported
if __name__ == "__main__":  # a mistyped key ends before torch's import, which takes seconds
    configurator.end_now_if_unreadable(EvalConfig, sys.argv[1:], "eval.py")

from ddpgpt import errors, evaluation, hellaswag, launch, runtime, sources, weights  # noqa: E402
from ddpgpt.errors import UserError  # noqa: E402
from ddpgpt.model import GPT, GPTConfig  # noqa: E402
from ddpgpt.settings import TrainConfig  # noqa: E402
from ddpgpt.state import Saved  # noqa: E402

log = logging.getLogger("ddpgpt.eval")


def main(argv):
    cfg, given = configurator.parse_given(EvalConfig, argv, "eval.py")
    # stdout is for the results
    with launch.session("eval.py", cfg.device, cfg.backend, cfg.dist_timeout_s,
                        standing=lambda: ("", "Nothing is lost: run it again."),
                        log_stream=sys.stderr) as s:
        cfg, model, loaded, ev, where = launch.start(s, lambda: start_up(cfg, given))
        model, autocast = model.to(s.device), runtime.precision(cfg.dtype, s.device).autocast
        results = evaluation.losses(model, ev, s.ranks, autocast, s.device) if ev.splits else {}
        if ev.hellaswag is not None:
            t0 = time.perf_counter()
            results.update(evaluation.hellaswag_scores(model, ev, s.ranks, autocast, s.device))
            results["hellaswag_s"] = time.perf_counter() - t0
        if s.ranks.master:
            print(summary(cfg, results, loaded.source, where, ev.hellaswag))
            print(json.dumps({**results, "model": loaded.source}))
    return 0


def start_up(cfg, given):
    """(the settings as the checkpoint trained with, the model on the CPU, weights.Loaded, the
    Evaluation, where its val split comes from)."""
    loaded = weights.load(cfg.init_from, cfg.out_dir, "give --out_dir a run's out_dir or one "
                          "checkpoint file, or --init_from=gpt2.")
    log.info(f"eval.py: {loaded.source}")
    positions = loaded.args["block_size"]
    if cfg.block_size > positions:
        raise UserError(f"block_size={cfg.block_size} is more than the model's {positions} "
                        f"positions: use block_size <= {positions}, or 0 for all of them.")
    # the loss as the run's was: over the tokenizer's ids, or every row in older checkpoints
    model = GPT(GPTConfig(**loaded.args), loaded.state and Saved.of(loaded.state).scored_ids)
    model.load_state_dict(loaded.weights)
    trained = Saved.of(loaded.state).config if loaded.state else {}  # {} for HF weights
    # the evaluation settings left at 0 as the checkpoint's run had them (train.py's defaults for
    # weights that come with no run), and block_size the model's
    cfg = dataclasses.replace(cfg, block_size=cfg.block_size or positions, **{
        key: getattr(cfg, key) or trained.get(key) or getattr(TrainConfig, key)
        for key in ("eval_iters", "batch_size")})
    val, where = val_split(cfg, trained, loaded) if cfg.val_loss else ({}, None)
    if val:
        log.info(f"eval.py: val loss on {where}, {cfg.eval_iters} x {cfg.batch_size} windows of "
                 f"{cfg.block_size} tokens")
    ev = make_evaluation(cfg, given, val, loaded)
    if not ev.splits and ev.hellaswag is None:
        raise UserError(f"there is nothing to evaluate: hellaswag=False, and {cfg.init_from} comes "
                        f"with no data for the val loss: give --data_dir=<a folder of its tokens>.")
    return cfg, model, loaded, ev, where


def val_split(cfg, trained, loaded):
    """({'val': Mixture}, where it comes from) to take the val loss on: data_dir, else the data
    the checkpoint trained on (its data_mix, data_dir, or nanoGPT's data/<dataset>); ({}, None)
    when there is none (GPT-2's weights without a data_dir)."""
    tok, vocab_size = loaded.tokenizer, loaded.args["vocab_size"]
    if cfg.data_dir:
        return {"val": sources.open_for_model(cfg.data_dir, "val", tok, cfg.block_size,
                                              vocab_size)}, cfg.data_dir
    mix = trained.get("data_mix")
    folder = loaded.state and Saved.of(loaded.state).data_dir
    if not (mix or folder):
        return {}, None
    where = f"data_mix={mix!r}" if mix else folder
    try:
        val = sources.open_splits(sources.parse_mix(mix), cfg.block_size, vocab_size,
                                  ("val",)) if mix else \
            {"val": sources.open_for_model(folder, "val", tok, cfg.block_size, vocab_size)}
    except UserError as e:
        raise UserError(f"the checkpoint trained on {where}, which cannot be read here: {e} "
                        f"Give --data_dir=<the same data's folder here>, or --val_loss=False "
                        f"for HellaSwag alone.") from e
    # the checkpoint's own data, prepared again since (other documents in val, perhaps ones it
    # trained on), would give a val loss that is not the one train.py logged: refused, as
    # train.py refuses to resume on other data
    before = (Saved.of(loaded.state).data_identity or {}).get("val")
    now = sources.identity(val)["val"]
    if before is not None and before != now:
        raise UserError(f"{where} is not the data the checkpoint was trained on: its val split is "
                        f"{now} (tokens and fingerprint per source), the checkpoint's was "
                        f"{before}, so it was prepared again since and this val loss would not be "
                        f"the run's. Point it at the data the run trained on, or give "
                        f"--data_dir=<a folder> to evaluate on that folder as it is now.")
    return val, f"{where}, the checkpoint's{'' if mix else ' data_dir'}"


def make_evaluation(cfg, given, val, loaded):
    """The Evaluation: HellaSwag as asked, or left out with one line when it was not asked for
    explicitly and its file is neither given, cached nor downloadable."""
    tok, vocab_size = loaded.tokenizer, loaded.args["vocab_size"]
    try:
        return evaluation.make(val, cfg, vocab_size, tok, cfg.hellaswag, cfg.hellaswag_path)
    except hellaswag.Unavailable as e:
        if "hellaswag" in given or not val:
            raise
        log.info(f"eval.py: HellaSwag skipped: {e} --hellaswag=False leaves it out without this "
                 f"line.")
        return evaluation.make(val, cfg, vocab_size, tok, False, "")


def summary(cfg, results, source, where, hellaswag_data):
    lines = [f"model: {source}"]
    if "val_loss" in results:
        windows = cfg.eval_iters * cfg.batch_size
        bpb = f", {results['val_bpb']:.4f} bits per byte" if "val_bpb" in results else ""
        lines.append(f"val: loss {results['val_loss']:.4f}{bpb} ({where}, {windows:,} windows "
                     f"of {cfg.block_size} tokens)")
    if "val_loss_docs" in results:
        lines.append(f"val, document-aligned: loss {results['val_loss_docs']:.4f} (as many "
                     f"windows, each starting where a document or a block of one starts)")
    if hellaswag_data is not None:
        n, seconds = results["hellaswag_n"], results["hellaswag_s"]
        right = {k: round(results[f"hellaswag_{k}"] * n) for k in ("acc_norm", "acc")}
        cut = f"; {hellaswag_data.truncated} cut to block_size" if hellaswag_data.truncated else ""
        lines.append(f"HellaSwag: acc_norm {right['acc_norm']}/{n} = "
                     f"{results['hellaswag_acc_norm']:.4f}, acc {right['acc']}/{n} = "
                     f"{results['hellaswag_acc']:.4f} ({hellaswag_data.path}, {seconds:.1f} s, "
                     f"{n / seconds:,.1f} examples/s{cut})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(errors.run(main, "eval.py", sys.argv[1:]))
