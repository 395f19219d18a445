"""Make the document index of a data folder's splits, which sampling='documents' reads (data.py),
for token files that have none: nanoGPT's train.bin and val.bin, llm.c's shards, ddpgpt folders made
before prepare.py wrote it with the tokens.

    python index_documents.py --data_dir=data/openwebtext    # nanoGPT's files, or an older folder
    python index_documents.py --data_dir=data/fineweb10B     # llm.c / modded-nanogpt shards

Each split's token files are read once, a chunk at a time (memory stays flat), at more than
1 GB of tokens per second from the page cache, with a progress bar. Its index,
<data_dir>/<split>.docidx (the format is docindex.py's), is written under a temporary name and
renamed when complete: a stopped run keeps the splits it finished and leaves nothing half
written, so running it again does the rest, and an index that still matches its token files is
kept. A document starts at each file's first token and after every end-of-text id: meta.json's,
or GPT-2's for nanoGPT's and llm.c's files, which have no meta.json (--eot_token=N for
another). Keys as in IndexConfig (ddpgpt/settings.py; `python index_documents.py --help`)."""
import contextlib
import sys
import time

from tqdm import tqdm

from ddpgpt import configurator, docindex, errors, fileio, lock, logs, signals, tokenfile
from ddpgpt.errors import Interrupted, UserError
from ddpgpt.settings import IndexConfig
from ddpgpt.tokenfile import GPT2_EOT  # nanoGPT's raw files and llm.c's shards hold GPT-2's


def end_of_text(cfg, meta):
    """The id that ends each document; None for data that has none (nanoGPT's characters: each file
    is one document). --eot_token is for folders without a meta.json (the error below says why)."""
    if meta is None:
        return cfg.eot_token if cfg.eot_token >= 0 else GPT2_EOT
    eot = meta.get("eot_token")
    if cfg.eot_token >= 0 and cfg.eot_token != eot:
        said = f"eot_token {eot}" if eot is not None else "no end-of-text id"
        raise UserError(f"--eot_token={cfg.eot_token} disagrees with {cfg.data_dir}/meta.json, "
                        f"which gives its tokens (tokenizer '{meta.get('tokenizer')}') {said}: "
                        f"prepare.py ended every document with that, and an index at another "
                        f"id would cut them elsewhere. Leave --eot_token out to index at "
                        f"meta.json's (it is for folders without one: nanoGPT's and llm.c's).")
    return eot


def index_split(token_split, data_dir, split, eot):
    """Make one split's index, unless the one there matches its token files and eot."""
    path = docindex.doc_index_path(data_dir, split)
    with contextlib.suppress(UserError):  # missing, damaged or stale: made again
        if docindex.open_doc_index(token_split, data_dir, split).eot == eot:
            print(f"{split}: {path} matches its token files: kept")
            return
    t0 = time.perf_counter()
    with tqdm(total=token_split.n_tokens, desc=split, unit=" tokens", unit_scale=True) as bar:
        docindex.build(token_split, path, eot, bar.update)
    seconds = time.perf_counter() - t0
    index = docindex.open_doc_index(token_split, data_dir, split)
    size = token_split.n_tokens * token_split.dtype.itemsize
    print(f"{split}: {index.documents:,} documents in {token_split.n_tokens:,} tokens -> {path} "
          f"({seconds:.1f} s, {size / seconds / 1e9:.2f} GB of tokens/s)")


def main(argv):
    signals.raise_on_stop_signals()
    cfg = configurator.parse(IndexConfig, argv, "index_documents.py")
    logs.setup()  # the package's lines (tokenfile's data: lines, the lock's), to stdout
    eot = end_of_text(cfg, tokenfile.read_meta(cfg.data_dir))
    print(f"index_documents.py: {cfg.data_dir}: " + (
        f"documents end with token {eot}" if eot is not None else
        "its tokens have no end-of-text id: each file is one document"))
    splits = {split: tokenfile.open_split(cfg.data_dir, split, block_size=1)  # checked first
              for split in tokenfile.SPLITS}
    try:
        with lock.locked(cfg.data_dir, "index_documents.py", fix=(
                f"each index goes beside its token files, so copy {cfg.data_dir} to a place "
                f"you can write in and run index_documents.py on the copy.")):
            fileio.remove_stale_temporaries(cfg.data_dir)  # of a killed run
            for split, token_split in splits.items():
                index_split(token_split, cfg.data_dir, split, eot)
    except Interrupted as e:  # the shell's convention: 128 + the signal's number
        print(f"index_documents.py: interrupted ({e}): the splits finished before are kept, and "
              f"nothing half written is left; run it again for the rest.", file=sys.stderr)
        return 128 + e.signum
    except OSError as e:  # a disk's error reading the tokens or writing the index
        raise UserError(f"{fileio.disk_full(e, cfg.data_dir) or e}: no index was left half "
                        f"written in {cfg.data_dir}; run it again when that is fixed.") from e
    return 0


if __name__ == "__main__":
    sys.exit(errors.run(main, "index_documents.py", sys.argv[1:]))
