"""Evaluation, the same for train.py's evaluations and eval.py: the mean loss over fixed windows
of each split, bits per byte, and HellaSwag (hellaswag.py), each shared out over the ranks.

The windows (data.eval_offsets) are spread evenly over a split and are the same for every run
and world size, so that losses are comparable: with the same eval_iters, batch_size and
block_size, eval.py's val loss is the one train.py reported. Beside it, where the val split has
its document index, val_loss_docs: the loss over as many fixed windows that start where
sampling='documents' starts them (data.eval_document_offsets), in whatever mode a run trains.
Bits per byte count the bytes that tokenizer.byte_lengths gives; docs/evaluation.md says why.
"""
import logging
import math
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist

from ddpgpt import data, hellaswag, runtime
from ddpgpt.errors import UserError
from ddpgpt.tokenizer import TokenizerChanged, byte_lengths, tokenizer_of

log = logging.getLogger(__name__)


class Evaluation(NamedTuple):
    """What an evaluation reads, made once per run."""
    splits: dict  # {split: data.Mixture}
    windows: dict  # {split: each source's fixed windows}
    val_docs: Optional[list]  # each val source's document-aligned windows; None: not all have
    block_size: int
    batch_size: int  # windows per forward
    eval_iters: int  # eval_iters * batch_size windows per split
    vocab_size: int  # the model's
    token_bytes: Any  # bytes per token id (an array), or None: no bits per byte
    hellaswag: Optional[hellaswag.HellaSwag]  # prepared, or None


def for_training(cfg, splits, meta, vocab_size):
    """train.py's Evaluation. Bits per byte and HellaSwag need the data's tokenizer (GPT-2's for
    nanoGPT's raw files, as sample.py assumes), with no more ids than the model has: without it
    the evaluations have no bits per byte, and hellaswag_interval is an error. One that is not
    the one the data was prepared with is an error in any case."""
    try:
        tok = tokenizer_of(meta, vocab_size)
    except TokenizerChanged:  # the data's own tokenizer, changed: its ids are not the data's
        raise
    except UserError as e:
        if cfg.hellaswag_interval:
            raise UserError(f"hellaswag_interval={cfg.hellaswag_interval} needs the data's "
                            f"tokenizer: {e}") from e
        log.info(f"note: the evaluations leave bits per byte out: {e}")
        tok = None
    return make(splits, cfg, vocab_size, tok, cfg.hellaswag_interval > 0, cfg.hellaswag_path)


def make(splits, cfg, vocab_size, tok, with_hellaswag, hellaswag_path):
    """An Evaluation of splits with cfg's block_size, batch_size and eval_iters. A HellaSwag
    batch holds batch_size x block_size tokens, as a training micro-batch does."""
    swag = hellaswag.prepare(hellaswag_path, tok, cfg.block_size,
                             cfg.batch_size * cfg.block_size) if with_hellaswag else None
    n = cfg.eval_iters * cfg.batch_size
    windows = {split: [data.eval_offsets(t.starts, cfg.block_size, n) for t in mix.splits]
               for split, mix in splits.items()}
    val, docs = splits.get("val"), None
    if val is not None and all(t.docs is not None for t in val.splits):
        try:
            docs = [data.eval_document_offsets(t, cfg.block_size, n) for t in val.splits]
        except UserError as e:  # a val split of end-of-text ids alone
            log.info(f"note: the evaluations leave the document-aligned val loss (val_loss_docs) "
                     f"out: {e}")
    return Evaluation(splits, windows, docs, cfg.block_size, cfg.batch_size, cfg.eval_iters,
                      vocab_size, None if tok is None else byte_lengths(tok, vocab_size), swag)


@torch.no_grad()
def losses(model, ev, ranks, autocast, device):
    """{'train_loss': ..., 'val_loss': ..., 'val_bpb': ..., 'val_loss_docs': ...}: each split's
    mean loss over its windows, and its bits per byte where the tokenizer is known; for a
    mixture, each source's too ('val_loss/web', 'val_bpb/web'), and the split's value is their
    average by weight."""
    was_training = model.training
    model.eval()
    out = {}
    for split, mix in ev.splits.items():
        results = [split_loss(model, t, offsets, ev, ranks, autocast, device)
                   for t, offsets in zip(mix.splits, ev.windows[split])]
        names = ("loss",) if ev.token_bytes is None else ("loss", "bpb")
        for k, what in enumerate(names):
            out.update(by_weight(f"{split}_{what}", [r[k] for r in results], mix))
    if ev.val_docs is not None:
        mix = ev.splits["val"]
        results = [split_loss(model, t, offsets, ev, ranks, autocast, device, bpb=False)
                   for t, offsets in zip(mix.splits, ev.val_docs)]
        out.update(by_weight("val_loss_docs", [r[0] for r in results], mix))
    model.train(was_training)
    return out


def by_weight(key, values, mix):
    """{key: the sources' values averaged by weight}, and each one's for a mixture."""
    out = {key: sum(w * v for w, v in zip(mix.weights, values))}
    if len(values) > 1:
        out.update({f"{key}/{n}": v for n, v in zip(mix.names, values)})
    return out


def split_loss(model, token_split, offsets, ev, ranks, autocast, device, bpb=True):
    """(mean loss, bits per byte or None) of one source's windows, shared out over the ranks.
    The losses stay on the device until the one transfer at the end."""
    mine = offsets[ranks.rank::ranks.world_size]
    bpb = bpb and ev.token_bytes is not None
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    windows = n_bytes = 0
    # every rank runs as many forwards as the rank with the most windows: under fsdp each one
    # gathers the weights with the other ranks. Every forward is of batch_size windows, as a
    # training micro-step's: a shorter last chunk would make torch.compile recompile the model
    # with a symbolic batch size, which the training step would then run. A chunk is filled up
    # with the first window, its targets -1 (ignored by the loss and its weight); a rank with a
    # batch fewer reads one such batch and does not count it
    for i in range(0, len(offsets[::ranks.world_size]), ev.batch_size):
        chunk = mine[i:i + ev.batch_size]
        x, y = data.read_xy(token_split, [*chunk, *[offsets[0]] * (ev.batch_size - len(chunk))],
                            ev.block_size, ev.vocab_size)
        y[len(chunk):] = -1
        with autocast:
            _, loss = model(*(runtime.to_device(torch.from_numpy(t), device) for t in (x, y)))
        if not len(chunk):
            continue
        # the mean over the chunk's targets, weighed by them in windows: fewer than the chunk's
        # where a window meets its file's end (-1 targets, in document-aligned windows)
        weight = int((y != -1).sum()) / ev.block_size
        loss_sum += loss.double() * weight
        windows += weight
        if bpb:
            n_bytes += int(ev.token_bytes[y[:len(chunk)]].sum())
    total = torch.stack([loss_sum, torch.full_like(loss_sum, windows),
                         torch.full_like(loss_sum, n_bytes)])
    if ranks.world_size > 1:
        dist.all_reduce(total)
    loss_sum, n, n_bytes = total.tolist()
    # every window's loss is the mean over its block_size targets: times block_size, the sum
    return loss_sum / n, loss_sum * ev.block_size / math.log(2) / n_bytes if bpb else None


def hellaswag_scores(model, ev, ranks, autocast, device):
    """{'hellaswag_acc_norm', 'hellaswag_acc', 'hellaswag_n', 'hellaswag_truncated'}. The model runs
    eagerly (fsdp's compiled blocks too): compiled, it would compile again for each new shape."""
    with torch.compiler.set_stance("force_eager"):
        return hellaswag.evaluate(model, ev.hellaswag, ranks.rank, ranks.world_size, autocast,
                                  device)


def describe(iter_num, results):
    """An evaluation as train.py's log line."""
    sources = ", ".join(f"{k.removeprefix('val_loss/')} {v:.4f}" for k, v in results.items()
                        if k.startswith("val_loss/"))
    bpb = f", {results['val_bpb']:.4f} bits per byte" if "val_bpb" in results else ""
    if "val_loss_docs" in results:
        bpb += f", document-aligned val loss {results['val_loss_docs']:.4f}"
    swag = "" if "hellaswag_n" not in results else (
        f", HellaSwag acc_norm {results['hellaswag_acc_norm']:.4f} (acc "
        f"{results['hellaswag_acc']:.4f}, {results['hellaswag_n']} examples)")
    return (f"iter {iter_num}: train loss {results['train_loss']:.4f}, val loss "
            f"{results['val_loss']:.4f}{f' ({sources})' if sources else ''}{bpb}{swag}")
