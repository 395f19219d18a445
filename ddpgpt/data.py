"""Which tokens each rank reads, step after step. The whole contract:

  1. Global batch `step` is the global samples [step * G, (step + 1) * G), where
     G = batch_size * gradient_accumulation_steps, whatever the world size.
  2. Rank r's micro-step m reads B = batch_size of them, starting at
     ((step * M + m) * W + r) * B, with W ranks of M micro-steps each (M * W fixed).
  3. Sample i comes from source s(i) of the mixture and is that source's sample j(i); with
     one source (the plain case) s = 0 and j = i. Of every MIX_BLOCK samples, a fixed number
     come from each source, as its weight says, in slots drawn from (seed, block).
  4. A source's sample j reads the window that starts at token offset o(j): a pure function of
     (seed, j), the split's file sizes and, in 'documents' mode, its document index. 'epoch'
     reads every block of the split once per epoch, in an order and at a phase drawn from
     (seed, epoch); 'random' draws windows uniformly, as nanoGPT; 'documents' reads every
     start once per epoch, in an order drawn from (seed, epoch): a start is a document's first
     token (tokenfile.py says where documents start) and, in a document longer than
     block_size + 1, every block_size-th token after it, so that each target of a document is
     in a window that starts in it. A split of many shards is one token space, and no window
     crosses from one file into the next.
  5. The window at offset o gives x = tokens[o : o + T] and y = tokens[o + 1 : o + T + 1]; where
     it meets its file's end ('documents' mode only), x goes on with token 0 and y with -1,
     which the loss ignores.

So no rank builds anything whose size depends on the data (start-up and memory do not grow
with it): what point 4 needs of a split (its files' blocks; in 'documents' mode its runs of
starts, from the index's distinct lengths) is computed once per source (windows()), never per
batch, and a batch costs the same whatever its sources. The ranks read disjoint slices of one
global batch, any world size reads the same global batches, and resuming needs one integer:
the number of samples consumed. The token files themselves are tokenfile.py's; the contract is
numpy's alone, and loader.py makes its batches tensors (train.py's, and a DataLoader's)."""
import hashlib
from itertools import count
from typing import Literal, NamedTuple, Optional, get_args

import numpy as np

from ddpgpt import docindex, tokenfile
from ddpgpt.errors import UserError
from ddpgpt.permutation import feistel_shape, hash64, hash_key, permute, round_keys, walk

Sampling = Literal["epoch", "random", "documents"]  # the sampling key's choices: point 4's modes
SAMPLING_MODES = get_args(Sampling)
# the domains of hash_key(seed, domain, ...): one per thing drawn
RANDOM_KEY, EPOCH_KEY, PHASE_KEY, MIX_KEY, DOCUMENTS_KEY = 1, 2, 3, 4, 5


# ---- points 1 and 2: global sample indices ----

def rank_sample_indices(step, micro_step, rank, world_size, batch_size, micro_steps):
    """Global sample indices of one rank's micro-batch (contract, point 2); for arrays of steps
    and micro-steps, of each of their micro-batches (a last axis of batch_size)."""
    first = ((np.asarray(step, dtype=np.int64) * micro_steps + micro_step) * world_size
             + rank) * batch_size
    return np.add.outer(first, np.arange(batch_size, dtype=np.int64))


# ---- points 3 and 4 draw with permutation.py's keyed permutations, O(1) memory ----

def locate(i, counts):
    """(file, index within that file) of item i of a sequence that is `counts[k]` items of each
    file k in turn: a binary search in the cumulative counts, nothing per item."""
    ends = np.cumsum(counts)
    k = np.searchsorted(ends, i, side="right")
    return k, i - (ends[k] - counts[k])


# ---- point 3: mixtures, the source each global sample comes from ----

MIX_BLOCK = 2**20  # the weights hold exactly over every MIX_BLOCK consecutive samples


class Mixture(NamedTuple):
    """The sources of one split's samples: each source's TokenSplit, how many of every
    MIX_BLOCK consecutive samples come from it, and its name in metrics; the sources' files as
    one token space, in which source s begins at token bases[s], to read a batch's windows in
    one pass (None where their formats differ); and the tables of point 4 for one block_size
    and mode, where with_windows() made them."""
    splits: tuple
    counts: tuple
    names: tuple
    joined: Optional[tokenfile.TokenSplit] = None
    bases: Optional[np.ndarray] = None
    windows: Optional["Windows"] = None

    @property
    def weights(self):
        return [c / MIX_BLOCK for c in self.counts]


def mixture(splits, weights=(1.0,), names=("",)):
    """A Mixture with these weights (shares of the samples), rounded to whole samples per
    MIX_BLOCK by largest remainder; one split alone is the plain case."""
    shares = np.asarray(weights, dtype=np.float64)
    shares = shares / shares.max()  # first: the sum of weights near 1e308 would overflow
    exact = shares / shares.sum() * MIX_BLOCK
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(counts - exact, kind="stable")[:MIX_BLOCK - counts.sum()]] += 1
    if not counts.all():
        raise UserError(f"a data_mix weight below 1/{MIX_BLOCK:,} of the total gets no samples "
                        f"(weights {', '.join(map(str, weights))}): raise it or leave the "
                        f"source out.")
    return Mixture(tuple(splits), tuple(counts.tolist()), tuple(names), *join(splits))


def join(splits):
    """(the sources' files as one token space, where each source begins in it): of two or more
    sources of one format (dtype and header), else (None, None)."""
    if len(splits) < 2 or not all(isinstance(t, tokenfile.TokenSplit) for t in splits) or \
            len({(t.dtype, t.header_bytes) for t in splits}) > 1:
        return None, None
    bases = np.concatenate([[0], np.cumsum([t.n_tokens for t in splits])])
    starts = np.concatenate([t.starts[:-1] + b for t, b in zip(splits, bases)] + [bases[-1:]])
    return (tokenfile.TokenSplit(sum((t.paths for t in splits), ()), splits[0].dtype,
                                 splits[0].header_bytes, starts), bases[:-1])


def source_indices(sample_indices, mix, seed):
    """(source, index among that source's samples) of each global sample. In block b of
    MIX_BLOCK samples, source s takes counts[s] slots, drawn from (seed, b), and its samples
    b * counts[s] onwards: so each source reads its own samples in order, every block of it
    once per its own epoch, and a source sampled less reaches its epoch boundary later."""
    indices = np.asarray(sample_indices, dtype=np.int64)
    if len(mix.counts) == 1:
        return np.zeros_like(indices), indices
    blocks, slots = indices // MIX_BLOCK, np.empty_like(indices)
    for block in np.unique(blocks):
        here = blocks == block
        slots[here] = permute(indices[here] % MIX_BLOCK, MIX_BLOCK, hash_key(seed, MIX_KEY, block))
    counts = np.asarray(mix.counts, dtype=np.int64)
    source, rank = locate(slots, counts)
    return source, blocks * counts[source] + rank


def sample_windows(sample_indices, mix, block_size, seed, mode):
    """(source, window offset in that source's split) of each global sample (points 3, 4)."""
    source, local = source_indices(sample_indices, mix, seed)
    return source, window_offsets(source, local, tables(mix, block_size, mode), seed)


def samples_fingerprint(sample_indices, mix, block_size, seed, mode):
    """A short hash of which windows a set of global samples reads, in any order: a loader
    that reports the indices it read (examples/lightning_datamodule.py) hashes them here."""
    source, offsets = sample_windows(sample_indices, mix, block_size, seed, mode)
    return hashlib.blake2b(np.sort(offsets + (source << 48)).tobytes(), digest_size=8).hexdigest()


def global_batch_fingerprint(step, global_batch, mix, block_size, seed, mode):
    """samples_fingerprint of global batch `step`, independent of how it is split across
    ranks and micro-steps: two runs that read the same data print the same value."""
    indices = np.arange(step * global_batch, (step + 1) * global_batch, dtype=np.int64)
    return samples_fingerprint(indices, mix, block_size, seed, mode)


# ---- point 4: a source's sample -> its window offset ----

class Windows(NamedTuple):
    """Point 4's tables for the sources of a Mixture, for one block_size and mode, made once
    by windows(). A source's samples of one epoch ('random': its window starts) are counted in
    units: its files in order ('documents': its runs, below), and the units of all sources
    make one sequence, so that one search finds any sample's unit, whatever its source.

    A run ('documents') is a range of levels that hold the same number of documents: a
    document's start k (k = 0 its first token, then k block_size later) is at level k, and the
    documents with a start at level k are the longest ones, the first of the index's length
    order. A run's sample q is at level at + q // size, in the (q % size)-th longest document."""
    mode: str
    block_size: int
    n: np.ndarray  # per source: samples per epoch ('random': window starts)
    base: np.ndarray  # per source: where its units begin in the sequence
    shape: tuple  # per source: feistel_shape(n), as three uint64 arrays
    firsts: np.ndarray  # per unit: where it begins in the sequence
    ends: np.ndarray  # per unit: where it ends
    at: np.ndarray  # per unit: its file's first token ('documents': the run's first level)
    size: np.ndarray  # per unit: 'epoch': phases to draw from (uint64); 'documents': documents
    indexes: tuple  # per source: its docindex.DocIndex ('documents'), else None


def blocks_per_epoch(n_tokens, block_size):
    """Non-overlapping blocks read in one epoch of a file of n_tokens (an int or an array of
    them). One block is left as slack where the file is long enough, so that each epoch can
    shift block boundaries by any phase in [0, block_size)."""
    whole = np.maximum((np.asarray(n_tokens) - 1) // block_size, 0)
    return np.where(whole >= 2, whole - 1, whole)


def check_mode(mode):
    if mode not in SAMPLING_MODES:
        raise ValueError(f"sampling mode {mode!r} is not one of {SAMPLING_MODES}")


def source_units(token_split, block_size, mode):
    """(count, at, size) of each unit of one source (Windows)."""
    starts = np.asarray(token_split.starts, dtype=np.int64)
    sizes = np.diff(starts)
    if mode == "random":  # any window inside a file, each as likely
        return np.maximum(sizes - block_size, 0), starts[:-1], np.zeros_like(sizes)
    if mode == "epoch":
        blocks = blocks_per_epoch(sizes, block_size)
        slack = np.clip(sizes - 1 - blocks * block_size, 0, block_size - 1)  # 0: a short file
        return blocks, starts[:-1], slack.astype(np.uint64) + np.uint64(1)
    if token_split.docs is None:
        raise ValueError("sampling mode 'documents' needs the split's document index: open it "
                         "with sources.open_split(..., mode='documents')")
    return document_runs(*docindex.doc_lengths(token_split.docs), block_size)


def document_runs(lengths, counts, block_size):
    """(starts, first level, documents per level) of each run of a split whose documents have
    these lengths (longest first) and counts. A document of L tokens has ceil((L - 1) / T)
    starts: one per block_size of its targets."""
    starts_each = (lengths - 2) // block_size + 1  # 0 for a document of one token
    at_least = np.cumsum(counts)  # documents at least as long as each length
    keep = starts_each > 0
    if not keep.any():  # nothing but end-of-text ids: no runs, which windows() refuses
        return (np.zeros(0, dtype=np.int64),) * 3
    starts_each, at_least = starts_each[keep], at_least[keep]
    last = np.append(starts_each[1:] != starts_each[:-1], True)  # each level count's last
    top, documents = starts_each[last][::-1], at_least[last][::-1]  # fewest starts first
    bottom = np.concatenate([[0], top[:-1]])
    return (top - bottom) * documents, bottom, documents


def windows(mix, block_size, mode):
    """The Windows of mix's sources for block_size and mode."""
    check_mode(mode)
    units = [source_units(t, block_size, mode) for t in mix.splits]
    counts = [np.asarray(c, dtype=np.int64) for c, _, _ in units]
    n = np.array([int(c.sum()) for c in counts], dtype=np.int64)
    if mode == "documents" and not n.all():
        empty = mix.splits[int(np.argmin(n))]
        raise UserError(f"{tokenfile.describe(empty)} holds no document of two tokens or more "
                        f"(its document index): it has no window that starts at a document's "
                        f"start to read.")
    ends = np.cumsum(np.concatenate(counts))
    shapes = [feistel_shape(k) for k in n.tolist()]
    return Windows(mode, block_size, n, np.concatenate([[0], np.cumsum(n)[:-1]]),
                   tuple(np.array(part, dtype=np.uint64) for part in zip(*shapes)),
                   ends - np.concatenate(counts), ends,
                   np.concatenate([a for _, a, _ in units]).astype(np.int64),
                   np.concatenate([s for _, _, s in units]),
                   tuple(t.docs if mode == "documents" else None for t in mix.splits))


def tables(mix, block_size, mode):
    """mix's Windows for block_size and mode: those with_windows() made, else new ones."""
    made = mix.windows
    return made if made is not None and (made.block_size, made.mode) == (block_size, mode) else \
        windows(mix, block_size, mode)


def with_windows(mix, block_size, mode):
    """mix with its Windows for block_size and mode, made now once for all its batches."""
    return mix._replace(windows=tables(mix, block_size, mode))


def epoch_keys(seed, epochs, domain):
    """Each sample's permutation round keys for its epoch, and its phase key: shared scalars
    when the samples are all of one epoch, as they nearly always are, else arrays."""
    if epochs.min() == epochs.max():  # a sort (np.unique) is a third of a draw's cost
        e = int(epochs.flat[0])
        return round_keys(hash_key(seed, domain, e)), np.uint64(hash_key(seed, PHASE_KEY, e))
    distinct, which = np.unique(epochs, return_inverse=True)
    keys = [round_keys(hash_key(seed, domain, e)) for e in distinct.tolist()]
    phases = [np.uint64(hash_key(seed, PHASE_KEY, e)) for e in distinct.tolist()]
    return (tuple(np.array(k, dtype=np.uint64)[which] for k in zip(*keys)),
            np.array(phases, dtype=np.uint64)[which])


def window_offsets(source, local, w, seed):
    """The offset of the window that each source's sample `local` reads (contract, point 4),
    all sources at once."""
    source = np.asarray(source, dtype=np.int64)
    local = np.asarray(local, dtype=np.int64)
    if w.mode == "random":
        drawn = hash64(local.astype(np.uint64) ^ np.uint64(hash_key(seed, RANDOM_KEY)))
        n = w.n[source].astype(np.uint64)
        unit, within = unit_of(w, source, (drawn % n).astype(np.int64))
        return w.at[unit] + within
    unit, within, phase = drawn_units(source, local, w, seed)
    if w.mode == "epoch":
        phase = (phase % w.size[unit]).astype(np.int64)
        return w.at[unit] + phase + within * w.block_size
    return document_offsets(w, source, unit, within)


def drawn_units(source, local, w, seed):
    """(unit, position within it, phase key) of each sample in its source's epoch order
    ('epoch' and 'documents' mode)."""
    n = w.n[source]
    keys, phase = epoch_keys(seed, local // n, EPOCH_KEY if w.mode == "epoch" else DOCUMENTS_KEY)
    shape = tuple(part[source] for part in w.shape)
    drawn = walk((local % n).astype(np.uint64), n.astype(np.uint64), shape, keys)
    return (*unit_of(w, source, drawn.astype(np.int64)), phase)


def unit_of(w, source, position):
    """(unit, position within it) of each source's sample position."""
    position = w.base[source] + position
    unit = np.searchsorted(w.ends, position, side="right")
    return unit, position - w.firsts[unit]


def document_offsets(w, source, unit, within):
    """The starts at these positions of their runs ('documents' mode): the document's first
    token, read from its source's index, plus block_size per level."""
    documents = w.size[unit]
    level, place = w.at[unit] + within // documents, within % documents
    first = np.empty_like(place)
    for s in np.unique(source).tolist():
        here = source == s
        first[here] = docindex.doc_starts(w.indexes[s], place[here])
    return first + level * w.block_size


def sample_offsets(sample_indices, token_split, block_size, seed, mode):
    """The start offset of the window each sample index of one split reads (point 4). The split
    is a TokenSplit, or in 'epoch' and 'random' mode its starts alone (TokenSplit.starts)."""
    if not isinstance(token_split, tokenfile.TokenSplit):
        token_split = tokenfile.TokenSplit((), np.dtype(np.uint16), 0,
                                           np.asarray(token_split, dtype=np.int64))
    return sample_windows(sample_indices, mixture([token_split]), block_size, seed, mode)[1]


def eval_offsets(starts, block_size, n_windows):
    """A fixed set of windows spread evenly over a split, the same for every run and world
    size, so that evaluation losses are comparable."""
    starts = np.asarray(starts, dtype=np.int64)
    windows = np.maximum(np.diff(starts) - block_size, 0)
    spread = np.linspace(0, windows.sum() - 1, num=n_windows).round().astype(np.int64)
    k, local = locate(spread, windows)
    return starts[k] + local


def eval_document_offsets(token_split, block_size, n_windows):
    """A fixed set of windows that start where 'documents' mode starts them, spread evenly over
    the split's starts: a document-aligned evaluation, the same for every run and world size."""
    w = windows(mixture([token_split]), block_size, "documents")
    spread = np.linspace(0, w.n[0] - 1, num=n_windows).round().astype(np.int64)
    source = np.zeros_like(spread)
    return document_offsets(w, source, *unit_of(w, source, spread))


# ---- point 5: windows -> (x, y) ----

def read_xy(token_split, offsets, block_size, vocab_size=None):
    """(x, y) int64 arrays of shape (len(offsets), block_size); y is x shifted by one, and -1
    past the end of a window's file. With vocab_size, ids the model cannot embed are a
    UserError here rather than a CUDA device-side assert later."""
    offsets = np.asarray(offsets, dtype=np.int64)
    windows = tokenfile.read(token_split, offsets, block_size + 1)
    if vocab_size is not None and windows.max() >= vocab_size:
        row = int(np.argmax(windows.max(axis=1) >= vocab_size))
        k = int(np.searchsorted(token_split.starts, offsets[row], side="right")) - 1
        raise UserError(
            f"{token_split.paths[k]} holds token id {int(windows[row].max())} in the window at "
            f"token offset {int(offsets[row] - token_split.starts[k])}, but the model's vocab_size "
            f"is {vocab_size}: the file was made with another tokenizer, or it is corrupt. Prepare "
            f"the data with the model's tokenizer, or set vocab_size above the largest id.")
    x = windows[:, :-1].astype(np.int64, order="C")
    y = windows[:, 1:].astype(np.int64, order="C")
    # where a window meets its file's end (sampling='documents'), x goes on with the 0s that
    # tokenfile filled in, and y's targets beyond the file's tokens are -1, which the loss ignores
    ends = token_split.starts[np.searchsorted(token_split.starts, offsets, side="right")]
    tokens = np.minimum(ends - offsets, block_size + 1)
    if (tokens < block_size + 1).any():
        y[np.arange(block_size) >= tokens[:, None] - 1] = -1
    return x, y


def read_mixture_xy(mix, source, offsets, block_size, vocab_size=None):
    """read_xy for windows of several sources, in the order given: in one pass over the
    sources' files as one token space, or where their formats differ each source's windows
    into their rows of x and y."""
    if len(mix.splits) == 1:
        return read_xy(mix.splits[0], offsets, block_size, vocab_size)
    if mix.joined is not None:
        return read_xy(mix.joined, offsets + mix.bases[source], block_size, vocab_size)
    x = np.empty((len(offsets), block_size), dtype=np.int64)
    y = np.empty_like(x)
    for s in np.unique(source).tolist():
        here = np.flatnonzero(source == s)
        x[here], y[here] = read_xy(mix.splits[s], offsets[here], block_size, vocab_size)
    return x, y


SAMPLE_AHEAD = 64  # micro-batches whose windows are drawn in one call: numpy's cost is per
# call, not per sample, so that 64 cost a rank about what one does


def rank_windows(mix, block_size, batch_size, micro_steps, rank, world_size, seed, mode,
                 start_step):
    """(source, offsets) of this rank's micro-batches in order from start_step, drawn
    SAMPLE_AHEAD micro-batches at a time. In 'documents' mode the starts are read from the
    index a micro-batch at a time: a first batch reads its own from a cold disk, not 64's."""
    w = tables(mix, block_size, mode)
    steps = max(1, SAMPLE_AHEAD // micro_steps)
    for first in count(start_step, steps):
        indices = rank_sample_indices(np.arange(first, first + steps)[:, None],
                                      np.arange(micro_steps), rank, world_size, batch_size,
                                      micro_steps).reshape(-1)
        source, local = source_indices(indices, mix, seed)
        if mode == "documents":
            unit, within, _ = drawn_units(source, local, w, seed)
        else:
            offsets = window_offsets(source, local, w, seed)
        for b in range(0, len(indices), batch_size):
            here = slice(b, b + batch_size)
            yield source[here], offsets[here] if mode != "documents" else \
                document_offsets(w, source[here], unit[here], within[here])
