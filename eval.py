"""Evaluate a model the way people report it: val loss and bits per byte on a data folder's val
split, and HellaSwag accuracy, on one process or many:

  python eval.py --out_dir=out-quickstart --data_dir=data/pystdlib     # a run's newest checkpoint
  python eval.py --out_dir=out/ckpt_0002000.pt --hellaswag=False --data_dir=data/openwebtext
  python eval.py --init_from=gpt2                                      # OpenAI's GPT-2 124M
  torchrun --standalone --nproc_per_node=8 eval.py --init_from=gpt2-xl --data_dir=data/openwebtext

The model is a run's out_dir (its newest checkpoint; nanoGPT's ckpt.pt too), one checkpoint file,
or GPT-2's weights by name or as a Hugging Face folder (ddpgpt/weights.py). Keys as in
EvalConfig (ddpgpt/settings.py; `python eval.py --help`). Progress goes to stderr; stdout gets a
summary, then one JSON line of the numbers (`python eval.py ... | tail -n 1`). What is measured,
and how, is ddpgpt/evaluation.py's: with train.py's eval_iters, batch_size and block_size, the
val loss is the one train.py reported.
"""
import dataclasses
import json
import sys
import time

from ddpgpt import configurator, errors, evaluation, runtime, sources, weights
from ddpgpt.errors import UserError
from ddpgpt.model import GPT, GPTConfig
from ddpgpt.settings import EvalConfig

NO_CHECKPOINT = "give --out_dir a run's out_dir or one checkpoint file, or --init_from=gpt2."


def main(argv):
    cfg = configurator.parse(EvalConfig, argv, "eval.py")
    ranks = runtime.ranks()
    log = runtime.logger(ranks, stream=sys.stderr)
    device = runtime.pick_device(cfg.device, ranks)
    model, loaded = load_model(cfg, log)
    cfg = dataclasses.replace(cfg, block_size=cfg.block_size or loaded.args["block_size"])
    vocab_size = loaded.args["vocab_size"]
    val = {} if not cfg.data_dir else {"val": sources.open_for_model(
        cfg.data_dir, "val", loaded.tokenizer, cfg.block_size, vocab_size, log)}
    ev = evaluation.make(val, cfg, vocab_size, loaded.tokenizer, cfg.hellaswag,
                         cfg.hellaswag_path, log)
    runtime.init_distributed(device, ranks.world_size, cfg.backend, cfg.dist_timeout_s)
    results = evaluate(model.to(device), ev, ranks, runtime.precision(cfg.dtype, device), device)
    if ranks.master:
        print(summary(cfg, results, loaded.source, ev.hellaswag))
        print(json.dumps({**results, "model": loaded.source}))
    runtime.finish(ranks.world_size)
    return 0


def load_model(cfg, log):
    """(the model on the CPU, weights.Loaded)."""
    loaded = weights.load(cfg.init_from, cfg.out_dir, NO_CHECKPOINT, log)
    log(f"eval.py: {loaded.source}")
    positions = loaded.args["block_size"]
    if cfg.block_size > positions:
        raise UserError(f"block_size={cfg.block_size} is more than the model's {positions} "
                        f"positions: use block_size <= {positions}, or 0 for all of them.")
    model = GPT(GPTConfig(**loaded.args))
    model.load_state_dict(loaded.weights)
    return model, loaded


def evaluate(model, ev, ranks, precision, device):
    """{'val_loss', 'val_bpb', 'hellaswag_...'}: what was asked for, on every rank."""
    results = {}
    if ev.splits:
        results.update(evaluation.losses(model, ev, ranks, precision.autocast, device))
    if ev.hellaswag is not None:
        t0 = time.perf_counter()
        results.update(evaluation.hellaswag_scores(model, ev, ranks, precision.autocast,
                                                   device))
        results["hellaswag_s"] = time.perf_counter() - t0
    return results


def summary(cfg, results, source, hellaswag_data):
    lines = [f"model: {source}"]
    if "val_loss" in results:
        windows = cfg.eval_iters * cfg.batch_size
        lines.append(f"val: loss {results['val_loss']:.4f}, {results['val_bpb']:.4f} bits per "
                     f"byte ({cfg.data_dir}, {windows:,} windows of {cfg.block_size} tokens)")
    if "val_loss_docs" in results:
        lines.append(f"val, document-aligned: loss {results['val_loss_docs']:.4f} (as many "
                     f"windows, each starting where a document or a block of one starts)")
    if hellaswag_data is not None:
        n, seconds = results["hellaswag_n"], results["hellaswag_s"]
        right = {k: round(results[f"hellaswag_{k}"] * n) for k in ("acc_norm", "acc")}
        cut = f"; {hellaswag_data.truncated} cut to block_size" if hellaswag_data.truncated \
            else ""
        lines.append(f"HellaSwag: acc_norm {right['acc_norm']}/{n} = "
                     f"{results['hellaswag_acc_norm']:.4f}, acc {right['acc']}/{n} = "
                     f"{results['hellaswag_acc']:.4f} ({hellaswag_data.path}, {seconds:.1f} s, "
                     f"{n / seconds:,.1f} examples/s{cut})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(errors.run(main, "eval.py", sys.argv[1:]))
