"""HellaSwag (Zellers et al., 2019), scored as llm.c and build-nanogpt score it, on all ranks;
docs/evaluation.md has acc and acc_norm, where the file comes from, and the numbers to compare.

The validation set is one JSON object a line: "ctx" (a context), "endings" (4 texts) and
"label" (the index of the right ending). An ending's row is the context's tokens followed by
the tokens of " " + ending; the model scores the ending's tokens, each predicted from the tokens
before it. A row longer than the model's block_size + 1 tokens is cut from the left, losing the
start of the context (and of the ending too, if the ending alone is longer than block_size); an
ending token is scored when a token precedes it in the row. llm.c instead stops on such an
example.

Examples are packed into batches of whole examples, shortest first, of at most `budget` input
tokens each (the four rows padded to the longest, the padding's targets -1, which the model
does not score). The batches are dealt out to the ranks in turn, and the counts summed: each
example is scored in the same batch on any world size, so the counts are the same to the bit.
"""
import fcntl
import http.client
import json
import logging
import os
import shutil
import urllib.request
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddpgpt import fileio, runtime
from ddpgpt.errors import UserError

log = logging.getLogger(__name__)

URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
FILE_NAME = "hellaswag_val.jsonl"
ENDINGS = 4
FORMAT = (f'each line of HellaSwag\'s validation file is a JSON object with "ctx" (the '
          f'context), "endings" ({ENDINGS} texts) and "label" (0 to {ENDINGS - 1}, the right '
          f'ending), as {URL} serves it: download it again, or fix the line')


class Example(NamedTuple):
    ctx: str
    endings: tuple
    label: int


class Batch(NamedTuple):
    x: torch.Tensor  # (4 x examples, width) int32 inputs
    y: torch.Tensor  # the same shape: the ending tokens to score, else -1
    labels: torch.Tensor  # (examples,)
    scored: torch.Tensor  # the flat indices of y's scored places, in order (int64)


class HellaSwag(NamedTuple):
    """The examples of a file, tokenized and packed for one model's tokenizer and block_size."""
    path: str
    batches: list
    n: int
    truncated: int  # examples with a row cut to fit block_size


# ---- the file: given, cached, or fetched once ----

class Unavailable(UserError):
    """No file given, none cached, and the download failed: eval.py goes on without HellaSwag
    when the user did not ask for it."""


def cache_dir():
    """$DDPGPT_CACHE, else ddpgpt's folder in the user's cache ($XDG_CACHE_HOME or ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("DDPGPT_CACHE") or os.path.join(base, "ddpgpt")


def locate(path):
    """The file to read: path when given; else the cached copy, downloaded the first time. Under
    a lock, so that of the processes that find no copy, one downloads and the others wait."""
    if path:
        if not os.path.isfile(path):
            raise UserError(f"hellaswag_path={path!r} is not a file: give HellaSwag's validation "
                            f"file ({URL}), or leave hellaswag_path empty to use the cached copy "
                            f"in {cache_dir()}, downloaded the first time.")
        return path
    cached = os.path.join(cache_dir(), FILE_NAME)
    if os.path.exists(cached):  # a cache folder that is read-only is fine once it holds the file
        return cached
    try:
        os.makedirs(cache_dir(), exist_ok=True)
        with open(cached + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.exists(cached):
                log.info(f"hellaswag: downloading {URL} to {cached}")
                with fileio.publishing(cached) as tmp:
                    with urllib.request.urlopen(URL, timeout=60) as response, open(tmp, "wb") as f:
                        shutil.copyfileobj(response, f)
                    read(tmp)  # a complete, well-formed file, or none at all
    except (OSError, http.client.HTTPException) as e:  # urllib's errors are OSErrors
        raise Unavailable(
            f"HellaSwag's validation set is not in {cache_dir()} and could not be downloaded "
            f"from {URL} ({getattr(e, 'reason', None) or e}). Where there is network, fetch it "
            f"once with `curl -L -o {FILE_NAME} {URL}`, copy the file here and give "
            f"--hellaswag_path={FILE_NAME} (or put it in that folder, where it is looked for "
            f"first; DDPGPT_CACHE chooses the folder).") from e
    return cached


def read(path):
    """The examples of a HellaSwag JSON-lines file; a line that is not one is a UserError."""
    examples = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    examples.append(parse(line, f"{path}, line {number}"))
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}): "
                        f"{FORMAT}.") from e
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror or e}): {FORMAT}.") from e
    if not examples:
        raise UserError(f"{path} holds no examples: {FORMAT}.")
    return examples


def parse(line, where):
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where} is not JSON ({e.msg}): {FORMAT}.") from e
    if problem := problem_of(obj):
        raise UserError(f"{where}: {problem}: {FORMAT}.")
    return Example(obj["ctx"], tuple(obj["endings"]), int(obj["label"]))


def problem_of(obj):
    """What is wrong with one parsed line, or None. A label may be a digit string, as in the
    Hugging Face copy of the data set."""
    if not isinstance(obj, dict):
        return f"a JSON {type(obj).__name__}, not an object"
    if missing := [key for key in ("ctx", "endings", "label") if key not in obj]:
        return f"no {', '.join(map(repr, missing))}"
    if not isinstance(obj["ctx"], str) or not obj["ctx"]:
        return f"the ctx {str(obj['ctx'])[:40]!r} is not a non-empty text"
    endings = obj["endings"]
    if not isinstance(endings, list) or len(endings) != ENDINGS or \
            not all(isinstance(e, str) for e in endings):
        return f"the endings {str(endings)[:60]} are not a list of {ENDINGS} texts"
    label = obj["label"]
    if isinstance(label, bool) or str(label) not in map(str, range(ENDINGS)):
        return f"the label {label!r} is not one of 0 to {ENDINGS - 1}"
    return None


# ---- tokens and batches ----

def render(example, encode, block_size):
    """(the four rows of token ids, how many tokens at the end of each are scored, whether a row
    was cut): a row is the context's tokens then those of " " + ending, cut from the left to the
    block_size + 1 tokens that block_size inputs predict."""
    context = encode(example.ctx)
    rows, scored, cut = [], [], False
    for ending in example.endings:
        tokens = encode(" " + ending)
        row = (context + tokens)[-(block_size + 1):]
        rows.append(row)
        scored.append(min(len(tokens), len(row) - 1))
        cut = cut or len(context) + len(tokens) > block_size + 1
    return rows, scored, cut


def make_batch(rendered, labels):
    """A Batch of rendered examples: inputs padded with id 0, targets -1 but the scored ones."""
    rows = [(row, s) for rows, scored, _ in rendered for row, s in zip(rows, scored)]
    x = torch.zeros((len(rows), max(len(row) for row, _ in rows) - 1), dtype=torch.int32)
    y = torch.full_like(x, -1)
    for i, (row, s) in enumerate(rows):
        n = len(row) - 1
        x[i, :n] = torch.tensor(row[:-1], dtype=torch.int32)
        y[i, n - s:n] = torch.tensor(row[-s:], dtype=torch.int32)
    return Batch(x, y, torch.tensor(labels, dtype=torch.long), (y.view(-1) >= 0).nonzero()[:, 0])


def pack(rendered, labels, budget):
    """Batches of whole examples, shortest first, of at most `budget` input tokens each (or one
    example, when it alone is more). Which examples share a batch depends on the file, the
    tokenizer, block_size and budget, never on the world size."""
    def width(i):
        return max(map(len, rendered[i][0])) - 1

    groups = [[]]  # each batch's examples
    for i in sorted(range(len(rendered)), key=width):
        if groups[-1] and ENDINGS * (len(groups[-1]) + 1) * width(i) > budget:
            groups.append([])
        groups[-1].append(i)
    return [make_batch([rendered[j] for j in g], [labels[j] for j in g]) for g in groups]


def prepare(path, tok, block_size, budget):
    """HellaSwag from path ('' for the cached copy), for a model of block_size positions."""
    path = locate(path)
    examples = read(path)
    rendered = [render(e, tok.encode, block_size) for e in examples]
    truncated = sum(cut for _, _, cut in rendered)
    if truncated:
        log.info(f"hellaswag: {truncated} of {len(examples)} examples are longer than "
                 f"block_size={block_size} + 1 tokens and are cut from the left")
    return HellaSwag(path, pack(rendered, [e.label for e in examples], budget), len(examples),
                     truncated)


# ---- scoring ----

def score(model, batch, autocast, device):
    """(right by the summed loss, right by the mean loss) in one batch, on the device. Only the
    scored positions' logits are taken to float32 for the cross-entropy. They are picked by the
    indices make_batch listed, not by a mask: indexing with a mask asks the device how many
    places it holds, a wait for the GPU on every batch, as a copy from pageable memory is."""
    x, y, labels, scored = (runtime.to_device(t, device) for t in batch)
    x, y = x.long(), y.long()
    with autocast:
        logits, _ = model(x, y)
    losses = torch.zeros(y.numel(), dtype=torch.float32, device=device)
    losses[scored] = F.cross_entropy(logits.flatten(0, 1)[scored].float(), y.view(-1)[scored],
                                     reduction="none")
    total = losses.view(y.shape).sum(dim=1).view(-1, ENDINGS)
    mean = total / (y >= 0).sum(dim=1).view(-1, ENDINGS)
    return torch.stack([(total.argmin(dim=1) == labels).sum(),
                        (mean.argmin(dim=1) == labels).sum()])


@torch.no_grad()
def evaluate(model, hellaswag, rank, world_size, autocast, device):
    """{'hellaswag_acc', 'hellaswag_acc_norm', 'hellaswag_n', 'hellaswag_truncated'}: this
    rank scores every world_size-th batch; one all-reduce sums the counts. Every rank runs as
    many forwards as the one with the most batches (under fsdp each gathers the weights with
    the other ranks): one with a batch fewer scores the first again and does not count it."""
    was_training = model.training
    model.eval()
    right = torch.zeros(2, dtype=torch.long, device=device)
    mine = hellaswag.batches[rank::world_size]
    for i in range(len(hellaswag.batches[::world_size])):
        counts = score(model, mine[i] if i < len(mine) else hellaswag.batches[0], autocast, device)
        right += counts if i < len(mine) else 0
    if world_size > 1:
        dist.all_reduce(right)
    model.train(was_training)
    acc, acc_norm = (right.double() / hellaswag.n).tolist()
    return {"hellaswag_acc": acc, "hellaswag_acc_norm": acc_norm, "hellaswag_n": hellaswag.n,
            "hellaswag_truncated": hellaswag.truncated}
