"""The data a run reads: its sources (data_dir, or the folders and weights of data_mix), each
split opened as a data.Mixture of the sources' token files, and what that data is (its
identity), which checkpoints keep and every rank must share."""
import dataclasses
import logging
import math
import os
from typing import NamedTuple

import numpy as np

from ddpgpt import data, docindex, tokenfile
from ddpgpt.errors import UserError
from ddpgpt.tokenizer import check_ids_fit, made_with, reads, same_ids

log = logging.getLogger(__name__)


class Source(NamedTuple):
    folder: str
    weight: float  # its share of the samples, before normalising
    name: str  # in metrics: val_loss/<name>; '' for data_dir alone


def of(cfg, given):
    """(the settings, the Sources of a run): data_mix's, else data_dir alone. Where both are
    set the later counts (config/owt.py's data_dir, then --data_mix), with a note; set in one
    place (both arguments, or one config file), they are an error (docs/bad_inputs.md)."""
    if "data_dir" in given and cfg.data_mix:
        later, earlier = sorted(("data_dir", "data_mix"), key=list(given).index, reverse=True)
        if given[later].startswith("argument") and given[earlier].startswith("argument") or \
                given[later] == given[earlier]:
            raise UserError(
                f"data_dir={cfg.data_dir!r} and data_mix={cfg.data_mix!r} are both set "
                f"({given['data_dir']}, {given['data_mix']}): keep data_mix (each source and "
                f"its weight) to train on the mixture, or drop it to train on data_dir alone.")
        log.info(f"note: {later}={getattr(cfg, later)!r} ({given[later]}) replaces "
                 f"{earlier}={getattr(cfg, earlier)!r} ({given[earlier]})")
        if later == "data_dir":
            cfg = dataclasses.replace(cfg, data_mix="")
    return cfg, parse_mix(cfg.data_mix) if cfg.data_mix else [Source(cfg.data_dir, 1.0, "")]


def parse_mix(data_mix):
    """The Sources of a data_mix string, 'folder=weight,...'."""
    found, bases = [], []
    for part in data_mix.split(","):
        folder, has_weight, weight = part.strip().rpartition("=")
        if not has_weight:  # a source without a weight weighs 1
            folder, weight = weight, "1"
        try:
            weight = float(weight)
        except ValueError:
            weight = None
        if weight is None or not 0 < weight < math.inf:
            raise UserError(f"data_mix source {part.strip()!r}: the weight must be a number "
                            f"above 0, as in data_mix='data/web=0.7,data/code=0.3'.")
        if not os.path.isdir(folder):
            raise UserError(f"data_mix source {folder!r} is not a folder: give each source as "
                            f"<data folder>=<weight>, separated by commas.")
        bases.append(os.path.basename(os.path.normpath(folder)))
        n = bases.count(bases[-1])  # the second data/web is web-2, the third web-3
        found.append(Source(folder, weight, bases[-1] if n == 1 else f"{bases[-1]}-{n}"))
    return found if len(found) > 1 else [Source(found[0].folder, 1.0, "")]


def read_meta(sources):
    """The meta.json the sources share: they must be of one tokenizer (tokenizer.same_ids)."""
    metas = [tokenfile.read_meta(s.folder) for s in sources]
    sizes = [(m or {}).get("vocab_size") for m in metas]
    if not all(same_ids(made_with(m), made_with(metas[0])) and n == sizes[0]
               for m, n in zip(metas, sizes)):
        detail = ", ".join(f"{s.folder}: {name!r}{f' (fingerprint {fp[:12]})' * bool(fp)}, "
                           f"{n} ids" for s, (name, fp), n in
                           zip(sources, map(made_with, metas), sizes))
        raise UserError(f"the data_mix sources were not made with one tokenizer ({detail}): "
                        f"prepare them all with the same --tokenizer (a Hugging Face one's "
                        f"files unchanged in between).")
    return metas[0]


def open_splits(sources, block_size, vocab_size, splits=tokenfile.SPLITS, mode="epoch"):
    """{split: the Mixture of the sources' token files}; one source is the plain case. Train's
    is made ready to sample in `mode` (data.with_windows)."""
    for s in sources:
        check_fits(s.folder, tokenfile.read_meta(s.folder), vocab_size)
    out = {}
    for split in splits:
        parts = [open_split(s.folder, split, block_size, mode) for s in sources]
        mix = data.mixture(parts, [s.weight for s in sources], [s.name for s in sources])
        out[split] = data.with_windows(mix, block_size, mode) if split == "train" else mix
    return out


def check_fits(folder, meta, vocab_size):
    """The ids of folder's data (meta: its meta.json, or None) must fit a model of vocab_size."""
    if meta is not None:
        check_ids_fit(meta["vocab_size"], f"{folder} ({meta.get('tokenizer')!r} tokens)",
                      vocab_size, "the model", f"use a model with vocab_size >= "
                      f"{meta['vocab_size']} (0 takes the data's), or data prepared with the "
                      f"tokenizer the model's weights were trained with.")


def open_split(folder, split, block_size, mode="epoch"):
    """One source's split (tokenfile.open_split), with its document index: train's in
    'documents' mode, which needs it; val's where there is one, for val_loss_docs."""
    token_split = tokenfile.open_split(folder, split, block_size)
    if split != "val" and not (split == "train" and mode == "documents"):
        return token_split
    try:
        return token_split._replace(docs=docindex.open_doc_index(token_split, folder, split))
    except UserError as e:
        if split != "val":  # 'documents' mode cannot go without it
            raise
        log.info(f"note: the evaluations leave the document-aligned val loss (val_loss_docs) "
                 f"out: {e}")
        return token_split


def open_for_model(data_dir, split, tok, block_size, vocab_size):
    """One split of data_dir, as a Mixture of one source, whose tokens must be the model's."""
    meta = tokenfile.read_meta(data_dir)
    used = (meta or {}).get("tokenizer")
    if used and not reads(tok, meta):
        raise UserError(f"{data_dir} holds {used!r} tokens, but the model reads {tok.name!r} "
                        f"tokens: give a data_dir prepared with --tokenizer={tok.name}.")
    check_fits(data_dir, meta, vocab_size)
    return data.mixture([open_split(data_dir, split, block_size)])


def identity(splits):
    """{split: [tokens, fingerprint] of each source, sorted}: what the data is, whatever its
    folder is called or its sources are weighed."""
    return {split: sorted([t.n_tokens, t.fingerprint] for t in mix.splits)
            for split, mix in splits.items()}


def check_same_data(what, before, now, checkpoint, allow):
    """Resuming "at the exact data position" of other data would be a silent lie: refuse it,
    unless the user says the change is meant (allow). before, now: identity() of the data
    checkpoint was trained on, and of this run's; what: the key that names this run's data."""
    if before is None or before == now:
        return
    if not allow:
        raise UserError(
            f"{what} is not the data {checkpoint} was trained on (tokens and fingerprint per "
            f"split: {before} then, {now} now): point it at that data again, or pass "
            f"--allow_data_change=True to go on from the same sample index in this data.")
    log.warning(f"warning: {what} is not the data {checkpoint} was trained on; going on from the "
                f"same sample index in it, as allow_data_change=True asks")


def check_same_on_all_ranks(identities, data_dir):
    """Every node must read the same token files, or the global batches are not one batch.
    identities: every rank's identity() (launch.gather)."""
    if any(i != identities[0] for i in identities):
        detail = "; ".join(f"rank {r}: {i}" for r, i in enumerate(identities))
        raise UserError(f"the ranks do not see the same data in {data_dir} (tokens, fingerprint "
                        f"per split: {detail}): every node must hold the same files.")


def log_train(mix, samples):
    """For a mixture, each source's share of the samples; for a mixture or in 'documents' mode,
    how many epochs of each source max_iters reads. mix is ready to sample (data.with_windows)."""
    w = mix.windows
    if len(mix.splits) == 1 and w.mode != "documents":
        return
    for k, (name, weight, token_split) in enumerate(zip(mix.names, mix.weights, mix.splits)):
        if w.mode == "documents":
            per_epoch, what = int(w.n[k]), "document starts"
        else:  # 'random' draws as many samples per epoch as 'epoch'
            per_epoch = int(data.blocks_per_epoch(np.diff(token_split.starts), w.block_size).sum())
            what = "blocks"
        share = f"{weight:.2%} of the samples, " if len(mix.splits) > 1 else ""
        log.info(f"data: {name or 'train'} ({os.path.dirname(token_split.paths[0])}): {share}"
                 f"{samples * weight / per_epoch:,.2f} epochs of its {per_epoch:,} {what} by "
                 f"max_iters")
