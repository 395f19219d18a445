"""Turn a text corpus (corpus.py reads them) into token files for training, in the formats
tokenfile.py describes: <out_dir>/train.bin, val.bin and meta.json, or with --shard_tokens shards of
about that many tokens each, in ddpgpt's raw format or llm.c's (--format=llmc).

    python prepare.py                                       # OpenWebText, from the HF hub
    python prepare.py --dataset=path/to/openwebtext         # a copy of its archives, offline
    python prepare.py --dataset=pystdlib --tokenizer=byte   # needs no network
    python prepare.py --dataset=my_texts/ --out_dir=data/mine
    python prepare.py --dataset=HuggingFaceFW/fineweb-edu --hub_config=sample-10BT \\
        --streaming --shard_tokens=100000000 --format=llmc  # 10B tokens, never stored raw

The corpus is read twice: pass 1 counts its non-empty documents, which fixes the train/val
split up front (meta.json's val_selection), and pass 2 tokenizes in a pool of workers, appending
each split's tokens to its file as they come back, so memory does not grow with the corpus.
docs/data.md says how a stopped prepare resumes (prepare.progress.json). Keys as in
PrepareConfig (`python prepare.py --help`)."""
import json
import math
import os
import sys
import time

import numpy as np
from tqdm import tqdm

from ddpgpt import (configurator, corpus, docindex, errors, fileio, lock, logs, permutation,
                    signals, tokenfile, workers)
from ddpgpt.errors import Interrupted, UserError
from ddpgpt.settings import PrepareConfig
from ddpgpt.tokenizer import GPT2_NAMES, get_tokenizer, torch_hidden

CHUNK_CHARS = 1 << 20  # text sent to a worker at a time: big enough to amortise the pickling


def validation_size(cfg, n_docs, description):
    if n_docs == 0:
        raise UserError(f"the corpus ({description}) holds no non-empty documents: check "
                        f"--dataset and --text_column.")
    if n_docs == 1:
        raise UserError(f"the corpus ({description}) is a single document (a .txt file is one "
                        f"document), which cannot be split into training and validation "
                        f"data: pass several files (a folder or a glob), or a .jsonl file "
                        f"with one document per line.")
    n_val = cfg.val_docs or max(1, round(n_docs * cfg.val_fraction))
    if not 1 <= n_val < n_docs:
        raise UserError(f"{n_val} validation documents out of the corpus's {n_docs} non-empty "
                        f"ones ({description}) leave no training or no validation data: pass a "
                        f"--val_docs or --val_fraction that keeps 1 to {n_docs - 1} documents "
                        f"for validation.")
    return n_val


# ---- pass 2: tokenizing in a pool of workers, in corpus order ----

def chunks(texts, n_docs, n_val, key, next_doc):
    """(texts, the split of each, the index of each) about CHUNK_CHARS characters at a time,
    without the documents (from 0, in corpus order) a resumed run has written already."""
    batch, size, first = [], 0, 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= CHUNK_CHARS:
            yield split_chunk(batch, first, n_docs, n_val, key, next_doc)
            first += len(batch)
            batch, size = [], 0
    if batch:
        yield split_chunk(batch, first, n_docs, n_val, key, next_doc)


def split_chunk(texts, first, n_docs, n_val, key, next_doc):
    indices = np.arange(first, first + len(texts))
    splits = np.where(permutation.permute(indices, n_docs, key) < n_val, "val", "train")
    keep = [i for i, (split, index) in enumerate(zip(splits, indices)) if index >= next_doc[split]]
    return ([texts[i] for i in keep], [str(splits[i]) for i in keep],
            [int(indices[i]) for i in keep])


_tokenizer = None  # each worker's own


def init_worker(tokenizer):
    """The main process's tokenizer, which the forked worker has as it is: no load per worker
    (a Hugging Face tokenizer's takes seconds)."""
    global _tokenizer
    _tokenizer = tokenizer
    # a Hugging Face tokenizer's batches on one thread: the workers are the parallelism, one
    # per core. One thread of its parallel path, not its sequential one: that costs a fifth
    # less CPU per token (benchmarks/preparing_hf.py). The pool is made on the first batch, here.
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    os.environ["RAYON_NUM_THREADS"] = "1"


def encode_chunk(task):
    """{split: (its documents' tokens, each document's length, each one's index)}."""
    texts, splits, indices = task
    out = {split: ([], [], []) for split in tokenfile.SPLITS}
    encoded = _tokenizer.encode_batch(texts) if _tokenizer.encode_batch else \
        map(_tokenizer.encode, texts)
    for tokens, split, index in zip(encoded, splits, indices):
        ids, lengths, where = out[split]
        ids.extend(tokens)
        ids.append(_tokenizer.eot)
        lengths.append(len(tokens) + 1)
        where.append(index)
    dtype = tokenfile.token_dtype(_tokenizer.vocab_size)
    return {split: (np.array(ids, dtype=dtype), lengths, where)
            for split, (ids, lengths, where) in out.items()}


# ---- output: each file written under a temporary name and renamed when complete ----

class SplitWriter:
    """One split's token files and document index. Tokens are appended to a temporary file
    (fileio.tmp_path) renamed when complete: at the end, or for shards at the end of the document
    that fills it (whole documents, so a run can resume from a document index). The documents'
    first tokens go to the index as written; a resumed run scans the shards it keeps for theirs."""

    def __init__(self, out_dir, split, *, shard_tokens, llmc_name, published, tokenizer):
        """shard_tokens: 0 for one file; llmc_name: llm.c's <name> of its shards, or None for
        ddpgpt's raw files; published: the shards a resumed run wrote (prepare.progress.json)."""
        self.out_dir, self.split = out_dir, split
        self.sharded = bool(shard_tokens) or llmc_name is not None
        self.shard_tokens = shard_tokens or math.inf
        self.prefix = f"{llmc_name}_" if llmc_name is not None else ""
        self.header_bytes = tokenfile.LLMC_HEADER_BYTES if llmc_name is not None else 0
        self.dtype, self.eot = tokenfile.token_dtype(tokenizer.vocab_size), tokenizer.eot
        self.shards = list(published)  # meta.json's entries, plus where each leaves the corpus
        self.file, self.tokens, self.documents = None, 0, 0
        self.index = docindex.Writer(docindex.doc_index_path(out_dir, split))
        kept = self.token_split()
        for k in range(len(kept.paths)):
            for starts in docindex.scan(kept, k, self.eot):
                self.index.add(starts)

    def token_split(self):
        """The shards published so far, as a TokenSplit."""
        paths = tuple(os.path.join(self.out_dir, s["file"]) for s in self.shards)
        return tokenfile.TokenSplit(paths, self.dtype, self.header_bytes, np.concatenate(
            [[0], np.cumsum([s["tokens"] for s in self.shards], dtype=np.int64)]))

    def name(self):
        return f"{self.prefix}{self.split}_{len(self.shards):06d}.bin" if self.sharded else \
            f"{self.split}.bin"

    def write(self, ids, lengths, indices, on_publish):
        """Append documents; on_publish() after each shard that this completes."""
        ends, done = np.cumsum(lengths), 0
        written = sum(s["tokens"] for s in self.shards) + self.tokens
        self.index.add(written + ends - lengths)  # each document's first token in the split
        while done < len(lengths):
            if self.file is None:
                self.file = open(fileio.tmp_path(os.path.join(self.out_dir, self.name())), "wb")
                self.file.write(bytes(self.header_bytes))  # room for llm.c's header
            # up to the first document that fills the shard, or all of them
            last = min(int(np.searchsorted(ends, ends[done] - lengths[done] - self.tokens
                                           + self.shard_tokens)), len(lengths) - 1)
            first_token, end_token = int(ends[done] - lengths[done]), int(ends[last])
            fileio.write_array(self.file, ids[first_token:end_token])
            self.tokens += end_token - first_token
            self.documents += last + 1 - done
            done = last + 1
            if self.tokens >= self.shard_tokens:
                self.publish(next_doc=indices[last] + 1)
                on_publish()

    def publish(self, next_doc):
        path = os.path.join(self.out_dir, self.name())
        if self.header_bytes:
            self.file.seek(0)
            self.file.write(np.array([tokenfile.LLMC_MAGIC, tokenfile.LLMC_VERSION, self.tokens],
                                     dtype="<i4").tobytes())
        self.file.close()
        # meta.json vouches for the files this one may replace
        fileio.remove(os.path.join(self.out_dir, tokenfile.META_NAME))
        fileio.publish(self.file.name, path)
        fingerprint = tokenfile.sampled_fingerprint([path], self.header_bytes)
        self.shards.append({"file": self.name(), "tokens": self.tokens, "documents": self.documents,
                            "next_doc": next_doc, "fingerprint": fingerprint})
        self.file, self.tokens, self.documents = None, 0, 0

    def finish(self):
        """Publish what is left, and meta.json's entry for the split."""
        if self.file is not None:
            self.publish(next_doc=None)
        paths = [os.path.join(self.out_dir, s["file"]) for s in self.shards]
        entry = {"tokens": sum(s["tokens"] for s in self.shards),
                 "documents": sum(s["documents"] for s in self.shards),
                 "fingerprint": tokenfile.sampled_fingerprint(paths, self.header_bytes)}
        if self.sharded:
            entry["shards"] = [{k: s[k] for k in ("file", "tokens", "documents", "fingerprint")}
                               for s in self.shards]
        self.index.finish(self.token_split()._replace(fingerprint=entry["fingerprint"]), self.eot)
        return entry

    def discard(self):
        self.index.discard()
        if self.file is not None:
            fileio.discard(self.file)


# ---- resuming: prepare.progress.json, rewritten after each published shard ----

def output_settings(cfg, llmc_name, docs, tokenizer):
    """What decides the bytes of the output: a run resumes only with the same, corpus files
    (corpus.files_identity) and tokenizer files (a Hugging Face one's may change) included."""
    return {"corpus": docs.identity, "dataset": cfg.dataset, "hub_config": cfg.hub_config or None,
            "text_column": cfg.text_column, "tokenizer": tokenizer.name,
            **tokenizer_fingerprint(tokenizer),
            "val_fraction": cfg.val_fraction, "val_docs": cfg.val_docs or None, "seed": cfg.seed,
            "shard_tokens": cfg.shard_tokens, "format": cfg.format, "llmc_name": llmc_name,
            "streaming": cfg.streaming}


def read_progress(out_dir, settings):
    """The progress of an interrupted run with the same settings whose shards are all still
    there, else None (and what such a run left is removed: it would be overwritten anyway)."""
    path = os.path.join(out_dir, tokenfile.PROGRESS_NAME)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            progress = json.load(f)
    except (OSError, ValueError):  # a progress file is written whole, so this is not ours
        progress = {"settings": None, "splits": {}, "header_bytes": 0}
    shards = [s for split in progress["splits"].values() for s in split]
    files = [os.path.join(out_dir, s["file"]) for s in shards]
    intact = all(os.path.isfile(file) and s["fingerprint"] == tokenfile.sampled_fingerprint(
        [file], progress["header_bytes"]) for s, file in zip(shards, files))
    if progress["settings"] == settings and intact:
        print(f"prepare.py: resuming an interrupted run in {out_dir}: "
              f"{len(shards)} complete shard(s) kept")
        return progress
    why = differences(progress["settings"], settings) if intact else \
        "whose shards are missing or changed"
    print(f"prepare.py: {out_dir} holds an interrupted run {why}: starting over")
    for file in filter(os.path.isfile, files):
        os.remove(file)
    os.remove(path)
    return None


def differences(before, now):
    """How the settings of an interrupted run differ from this one's, for the log."""
    if not isinstance(before, dict):
        return "whose settings are not recorded"
    changed = [k for k in now if before.get(k) != now[k]]
    detail = "; ".join(f"{k} {before.get(k)!r} then, {now[k]!r} now" for k in changed)
    return f"of a corpus that has changed since (files added, removed or edited: {detail})" \
        if "corpus" in changed else f"with other settings ({detail})"


def save_progress(out_dir, settings, counts, writers):
    fileio.write_json(os.path.join(out_dir, tokenfile.PROGRESS_NAME), {
        "settings": settings, "counts": counts, "header_bytes": writers["train"].header_bytes,
        "splits": {split: w.shards for split, w in writers.items()}})


def tokenizer_fingerprint(tokenizer):
    """meta.json's record of a Hugging Face tokenizer's fingerprint; the others have none."""
    return {"tokenizer_fingerprint": tokenizer.fingerprint} if tokenizer.fingerprint else {}


def write_tokens(writers, texts, counts, n_val, cfg, tokenizer, on_publish):
    """Pass 2: tokenize the documents not written yet, appending them to their split."""
    next_doc = {split: w.shards[-1]["next_doc"] if w.shards else 0 for split, w in writers.items()}
    done = sum(s["documents"] for w in writers.values() for s in w.shards)
    work = chunks(texts, counts["documents"], n_val, permutation.hash_key(cfg.seed), next_doc)
    with workers.ordered_map(encode_chunk, work, cfg.num_proc, init_worker,
                             (tokenizer,)) as results, \
            tqdm(total=counts["documents"], initial=done, desc="tokenizing", unit=" docs") as bar:
        for result in results:
            signals.raise_if_stopped()
            for split, tokens in result.items():
                writers[split].write(*tokens, on_publish)
            bar.update(sum(len(lengths) for _, lengths, _ in result.values()))


def complete_output(out_dir, settings):
    """Does out_dir hold this very output, complete (the same settings, the same corpus)?"""
    meta_path = os.path.join(out_dir, tokenfile.META_NAME)
    if not os.path.exists(meta_path):
        return False
    meta = tokenfile.read_meta(out_dir)
    if meta.get("prepared_with") == settings:
        return True
    how = differences(meta.get("prepared_with"), settings)
    raise UserError(
        f"{out_dir} holds a complete prepared dataset ({meta_path}: {meta.get('tokenizer')!r} "
        f"tokens of {meta.get('source')!r}, {how}), which this sharded prepare would replace "
        f"shard by shard, so that a stop midway would leave neither dataset. Remove it first "
        f"(rm -r {out_dir}), or give another --out_dir.")


def prepare(cfg):
    """(out_dir, meta.json's splits, the corpus's counts) of a complete prepare; splits and
    counts are None when out_dir already held its output."""
    with torch_hidden():  # prepare.py never uses torch
        tokenizer = get_tokenizer(cfg.tokenizer)
    if tokenizer.eot is None:  # a Hugging Face tokenizer's: the others by name have one
        raise UserError(f"the tokenizer {cfg.tokenizer!r} has neither an eos token nor a pad "
                        f"token, and prepare.py ends every document with one of them (eos, else "
                        f"pad): give it an eos token and save it again, e.g. tok = "
                        f"AutoTokenizer.from_pretrained({tokenizer.name!r}); "
                        f"tok.add_special_tokens({{'eos_token': '<|endoftext|>'}}); "
                        f"tok.save_pretrained(folder), and pass --tokenizer=folder.")
    if cfg.format == "llmc" and tokenizer.name not in GPT2_NAMES:
        # llm.c's header names no tokenizer: its magic says uint16 GPT-2 ids
        raise UserError(f"--format=llmc writes llm.c's GPT-2 shards, whose header (magic "
                        f"{tokenfile.LLMC_MAGIC}) says the ids are GPT-2's: llm.c, modded-nanogpt "
                        f"and train.py would read {cfg.tokenizer!r} ids ({tokenizer.vocab_size} of "
                        f"them) as GPT-2 tokens. Use --tokenizer=gpt2, or --format=raw, whose "
                        f"meta.json names the tokenizer.")
    docs = corpus.open_corpus(cfg.dataset, cfg.text_column, cfg.num_proc, cfg.streaming,
                              cfg.hub_config)
    out_dir = cfg.out_dir or os.path.join("data", docs.name)
    if os.path.isdir(cfg.dataset) and os.path.realpath(out_dir) == os.path.realpath(cfg.dataset):
        raise UserError(f"--out_dir={out_dir} is the corpus folder itself: its token files and "
                        f"meta.json would be mixed with the documents. Pass an --out_dir "
                        f"outside it, or a folder inside it (which prepare.py skips when it "
                        f"reads the corpus).")
    llmc_name = docs.name.replace("_", "-")  # llm.c's names are <name>_<split>_<index>.bin
    settings = output_settings(cfg, llmc_name, docs, tokenizer)
    with lock.locked(out_dir, "prepare.py"):  # a second prepare would destroy this one's output
        if stale := fileio.remove_stale_temporaries(out_dir):
            print(f"prepare.py: removed {len(stale)} temporary file(s) that a killed run left "
                  f"in {out_dir}")
        progress = read_progress(out_dir, settings)
        if progress is None and (cfg.shard_tokens or cfg.format == "llmc") and \
                complete_output(out_dir, settings):
            return out_dir, None, None
        counts = progress["counts"] if progress else docs.count()
        n_val = validation_size(cfg, counts["documents"], docs.description)
        published = (progress or {}).get("splits", {})
        writers = {split: SplitWriter(out_dir, split, shard_tokens=cfg.shard_tokens,
                                      llmc_name=llmc_name if cfg.format == "llmc" else None,
                                      published=published.get(split, []), tokenizer=tokenizer)
                   for split in tokenfile.SPLITS}
        splits = write_outputs(out_dir, writers, tokenizer, docs, counts, n_val, cfg, settings)
    return out_dir, splits, counts


def write_outputs(out_dir, writers, tokenizer, docs, counts, n_val, cfg, settings):
    """Pass 2 and meta.json. On every way out before the end (an error, a full disk, a signal)
    this run's temporary files are removed, and the shards it published stay, with the
    progress file that resumes after them."""
    try:
        write_tokens(writers, filter(corpus.is_document, docs.documents()), counts, n_val,
                     cfg, tokenizer, lambda: save_progress(out_dir, settings, counts, writers))
        signals.raise_if_stopped()
        splits = {split: w.finish() for split, w in writers.items()}
        tokenfile.write_meta(
            out_dir, tokenizer=tokenizer.name, vocab_size=tokenizer.vocab_size,
            eot_token=tokenizer.eot, **tokenizer_fingerprint(tokenizer), splits=splits,
            source=cfg.dataset, source_detail=docs.description, text_column=cfg.text_column,
            seed=cfg.seed, val_selection=f"non-empty document d (from 0, in corpus order) is in "
                                         f"val iff permutation.permute(d, {counts['documents']}, "
                                         f"permutation.hash_key({cfg.seed})) < {n_val}",
            skipped_empty_documents=counts["empty"], prepared_with=settings,
            skipped_undecodable_files=counts["undecodable"],
            **({"format": "llmc"} if cfg.format == "llmc" else {}),
            **({"shard_tokens": cfg.shard_tokens} if cfg.shard_tokens else {}))
    except BaseException as e:
        full = isinstance(e, OSError) and fileio.disk_full(e, out_dir)  # before space is freed
        for w in writers.values():
            w.discard()
        fileio.remove_own_temporaries(out_dir)
        if full:
            raise UserError(f"{full}. Nothing published before was damaged: "
                            f"{what_is_left(out_dir, writers)}. Free space there, or pass an "
                            f"--out_dir on a disk with room, and run again.") from e
        if isinstance(e, Interrupted):
            e.left = what_is_left(out_dir, writers)
        raise
    fileio.remove(os.path.join(out_dir, tokenfile.PROGRESS_NAME))
    return splits


def what_is_left(out_dir, writers):
    """What a run that stopped before the end leaves in out_dir, after its writers' discard:
    the progress file says what the same command resumes after."""
    path = os.path.join(out_dir, tokenfile.PROGRESS_NAME)
    recorded = 0
    if os.path.exists(path):
        with open(path) as f:
            recorded = sum(map(len, json.load(f)["splits"].values()))
    published = sum(len(w.shards) for w in writers.values())
    removed = "this run's temporary files were removed"
    if recorded:
        return (f"{removed}, and the {recorded} complete shard(s) in {out_dir} that "
                f"{tokenfile.PROGRESS_NAME} records are kept: the same command resumes after them")
    if published:  # the progress file could not be written after the first shard
        return (f"{removed}; the {published} shard(s) it published are not recorded in "
                f"{tokenfile.PROGRESS_NAME}, so the same command starts over")
    return f"{removed}, and no new output was published"


def main(argv):
    signals.raise_on_stop_signals()
    cfg, given = configurator.parse_given(PrepareConfig, argv, "prepare.py")
    logs.setup()  # the package's lines (the lock's notices), to stdout
    # the keys that choose the validation documents, checked before the corpus is read
    if {"val_docs", "val_fraction"} <= given.keys():
        raise UserError("--val_docs and --val_fraction both choose the validation documents: "
                        "give one of them.")
    if "val_docs" in given and cfg.val_docs == 0:  # the default's 0 is 'unset'; a given one, none
        raise UserError("--val_docs=0 leaves no val split: give --val_docs=1 or more, or "
                        "leave it out and use --val_fraction.")
    t0 = time.time()
    try:
        out_dir, splits, counts = prepare(cfg)
        if splits is None:
            print(f"prepare.py: {out_dir} already holds this output, complete (its "
                  f"{tokenfile.META_NAME} was made with the same settings from the same "
                  f"corpus files): nothing to do")
            return 0
    except OSError as e:  # a disk's error reading the corpus or writing: what it said
        raise UserError(str(e)) from e
    except Interrupted as e:  # the shell's convention: 128 + the signal's number
        print(f"prepare.py: interrupted ({e}); {e.left}.", file=sys.stderr)
        return 128 + e.signum
    elapsed = time.time() - t0
    for split, entry in splits.items():
        files = [s["file"] for s in entry.get("shards", [])] or [f"{split}.bin"]
        size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in files)
        where = os.path.join(out_dir, files[0]) + (f" and {len(files) - 1} more shard(s)"
                                                   if len(files) > 1 else "")
        print(f"{split:5s}: {entry['tokens']:,} tokens, {entry['documents']:,} documents -> "
              f"{where} ({size / 1e6:.1f} MB)")
    print(f"meta : {os.path.join(out_dir, tokenfile.META_NAME)}")
    named = counts.get("undecodable_files", [])
    which = f" ({', '.join(named[:corpus.NAMED])}{', ...' * (len(named) > corpus.NAMED)})" \
        if named else ""
    print(f"skipped {counts['empty']:,} empty documents, {counts['undecodable']:,} undecodable "
          f"files{which}; {sum(e['tokens'] for e in splits.values()) / elapsed:,.0f} tokens/s, "
          f"{elapsed:.1f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(errors.run(main, "prepare.py", sys.argv[1:]))
