"""Evaluate a model the way people report it: val loss and bits per byte on a data folder's val
split, and HellaSwag accuracy (hellaswag.py), on one process or many:

  python eval.py --out_dir=out-quickstart --data_dir=data/pystdlib     # a run's newest checkpoint
  python eval.py --out_dir=out/ckpt_0002000.pt --hellaswag=False --data_dir=data/openwebtext
  python eval.py --init_from=gpt2                                      # OpenAI's GPT-2 124M
  torchrun --standalone --nproc_per_node=8 eval.py --init_from=gpt2-xl --data_dir=data/openwebtext

The model is a run's out_dir (its newest checkpoint; nanoGPT's ckpt.pt too), one checkpoint file,
or GPT-2's weights by name or as a Hugging Face folder (weights.py). Keys as in EvalConfig, set
by config files and --key=value (configurator.py). Progress goes to stderr; stdout gets a
summary, then one JSON line of the numbers (`python eval.py ... | tail -n 1`).

Bits per byte: the summed cross-entropy of the target tokens of every window scored, in bits,
over the bytes of text those same tokens stand for, end-of-text counting as one byte
(tokenizer.byte_lengths); on byte-tokenized data it is the val loss / ln 2 exactly, and it
compares models whatever their tokenizer. The windows are train.py's evaluation windows, so
with the same eval_iters, batch_size and block_size the val loss is the one train.py reports.
"""
import functools
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

import configurator
import data
import errors
import hellaswag
import hf
import startup
import tokenfile
import train
import weights
from errors import UserError
from model import GPT, GPTConfig
from tokenizer import byte_lengths

NO_CHECKPOINT = "give --out_dir a run's out_dir or one checkpoint file, or --init_from=gpt2."


@dataclass
class EvalConfig:
    init_from: str = "resume"  # resume: out_dir's newest checkpoint; or gpt2... or an HF folder
    out_dir: str = "out"  # a run's out_dir, or one checkpoint file
    data_dir: str = ""  # val loss and bits per byte on its val split; '' leaves them out
    eval_iters: int = 200  # as train.py: eval_iters * batch_size windows of block_size tokens
    batch_size: int = 12  # windows per forward; a HellaSwag batch is batch_size * block_size tokens
    block_size: int = 0  # 0: the model's
    hellaswag: bool = True
    hellaswag_path: str = ""  # HellaSwag's validation file; '' for the cached copy, fetched once
    device: str = "auto"  # 'auto' and 'cuda': cuda:<local rank> when CUDA is there, else cpu
    dtype: startup.Dtype = "auto"  # 'auto': bfloat16 on CUDA that has it; float32 on CPU
    backend: Literal["", "nccl", "gloo"] = ""  # '' picks nccl on CUDA, gloo on CPU
    dist_timeout_s: int = 600


def check_config(cfg):
    for key, ok, need in (
            ("batch_size", cfg.batch_size >= 1, "at least 1"),
            ("eval_iters", cfg.eval_iters >= 1, "at least 1"),
            ("block_size", cfg.block_size >= 0, "at least 0 (0: the model's)"),
            ("hellaswag", cfg.hellaswag or cfg.data_dir, "True when no data_dir is given: "
                                                         "there is nothing else to evaluate"),
            ("device", not cfg.device.startswith("cuda") or torch.cuda.is_available(),
             "'cpu' or 'auto' here: torch sees no CUDA device")):
        if not ok:
            raise UserError(f"{key}={getattr(cfg, key)!r} must be {need}")
    hf.check_init_from(cfg.init_from, ("resume",))


def load_model(cfg, log):
    """(the model on the CPU, weights.Loaded); cfg.block_size becomes the one evaluated."""
    loaded = weights.load(cfg.init_from, cfg.out_dir, NO_CHECKPOINT, log)
    log(f"eval.py: {loaded.source}")
    positions = loaded.args["block_size"]
    if cfg.block_size > positions:
        raise UserError(f"block_size={cfg.block_size} is more than the model's {positions} "
                        f"positions: use block_size <= {positions}, or 0 for all of them.")
    cfg.block_size = cfg.block_size or positions
    model = GPT(GPTConfig(**loaded.args))
    model.load_state_dict(loaded.weights)
    return model, loaded


def open_val(cfg, tok, vocab_size, log):
    """The val split of data_dir, as a Mixture of one source; its tokens must be the model's."""
    used = (tokenfile.read_meta(cfg.data_dir) or {}).get("tokenizer")
    same = used == tok.name or {used, tok.name} <= set(hf.GPT2_TOKENIZERS)
    if used and not same:
        raise UserError(f"{cfg.data_dir} holds {used!r} tokens, but the model reads "
                        f"{tok.name!r} tokens: give a data_dir prepared with "
                        f"--tokenizer={tok.name}.")
    return data.mixture([tokenfile.open_split(cfg.data_dir, "val", cfg.block_size, vocab_size,
                                              log=log)])


def evaluate(cfg, model, vocab_size, val, token_bytes, swag, rank, world_size, device):
    """{'val_loss', 'val_bpb', 'hellaswag_...'}: what was asked for, on every rank."""
    device_type = torch.device(device).type
    autocast = train.autocast_for(startup.pick_dtype(cfg, device_type), device_type)
    model.to(device)
    results = {}
    if val is not None:
        results.update(train.evaluate(model, {"val": val}, cfg, rank, world_size, autocast,
                                      device, vocab_size, token_bytes))
    if swag is not None:
        t0 = time.perf_counter()
        results.update(hellaswag.evaluate(model, swag, rank, world_size, autocast, device))
        results["hellaswag_s"] = time.perf_counter() - t0
    return results


def summary(cfg, results, source, swag):
    lines = [f"model: {source}"]
    if "val_loss" in results:
        windows = cfg.eval_iters * cfg.batch_size
        lines.append(f"val: loss {results['val_loss']:.4f}, {results['val_bpb']:.4f} bits per "
                     f"byte ({cfg.data_dir}, {windows:,} windows of {cfg.block_size} tokens)")
    if swag is not None:
        n, seconds = results["hellaswag_n"], results["hellaswag_s"]
        right = {k: round(results[f"hellaswag_{k}"] * n) for k in ("acc_norm", "acc")}
        cut = f"; {swag.truncated} cut to block_size" if swag.truncated else ""
        lines.append(f"HellaSwag: acc_norm {right['acc_norm']}/{n} = "
                     f"{results['hellaswag_acc_norm']:.4f}, acc {right['acc']}/{n} = "
                     f"{results['hellaswag_acc']:.4f} ({swag.path}, {seconds:.1f} s, "
                     f"{n / seconds:,.1f} examples/s{cut})")
    return "\n".join(lines)


def main(argv):
    cfg = configurator.parse(EvalConfig, argv)
    check_config(cfg)
    rank, local_rank, world_size = startup.distributed_env()
    log = functools.partial(print, file=sys.stderr) if rank == 0 else (lambda *a, **k: None)
    model, loaded = load_model(cfg, log)
    vocab_size = loaded.args["vocab_size"]
    val = open_val(cfg, loaded.tokenizer, vocab_size, log) if cfg.data_dir else None
    swag = hellaswag.prepare(cfg.hellaswag_path, loaded.tokenizer, cfg.block_size,
                             cfg.batch_size * cfg.block_size, log) if cfg.hellaswag else None
    device = startup.pick_device(cfg.device, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    startup.init_distributed(cfg, device, world_size)
    results = evaluate(cfg, model, vocab_size, val, byte_lengths(loaded.tokenizer, vocab_size),
                       swag, rank, world_size, device)
    if rank == 0:
        print(summary(cfg, results, loaded.source, swag))
        print(json.dumps({**results, "model": loaded.source}))
    if world_size > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(errors.run(main, "eval.py", sys.argv[1:]))
