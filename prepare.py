"""
Turn a text corpus into token files for training: <out_dir>/train.bin, val.bin and meta.json,
in the format tokenfile.py describes.

    python prepare.py                                       # OpenWebText, from the HF hub
    python prepare.py --dataset=path/to/openwebtext         # a copy of its archives, offline
    python prepare.py --dataset=pystdlib --tokenizer=byte   # needs no network
    python prepare.py --dataset=my_texts/ --out_dir=data/mine

The corpus is read twice: once to check it and count its non-empty documents, which fixes the
train/val split up front, and once to tokenize. Documents stream through a pool of workers in
chunks and their tokens are appended to the output files as they come back, so memory does not
grow with the corpus (OpenWebText is 9B tokens).
"""
import argparse
import glob
import json
import lzma
import os
import re
import signal
import sys
import sysconfig
import tarfile
import time
import tokenize
from collections import Counter, deque
from multiprocessing import Pool

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

import data
import fileio
import tokenfile
from errors import UserError
from tokenizer import get_tokenizer

EXTENSIONS = (".txt", ".jsonl", ".json", ".parquet")
CHUNK_CHARS = 1 << 20  # text sent to a worker at a time: big enough to amortise the pickling


# ---- reading: each source is a function that yields one string per document ----

def utf8_lines(path):
    # newline="" keeps the text exactly as it is in the file, \r\n included
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            yield from f
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text ({e}): convert it to UTF-8 (e.g. with "
                           f"iconv) or move it out of the corpus.") from e


def parse_json(text, where):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{where} is not valid JSON ({e}).") from e


def text_field(record, column, where):
    if not isinstance(record, dict) or column not in record:
        has = sorted(record) if isinstance(record, dict) else f"a JSON {type(record).__name__}"
        raise UserError(f"{where} has no {column!r} field (it has: {has}): pass "
                           f"--text_column=<the field that holds the text>.")
    if not isinstance(record[column], (str, type(None))):
        raise UserError(f"{where}: {column!r} holds a {type(record[column]).__name__}, not "
                           f"text: pass --text_column=<the field that holds the text>.")
    return record[column] or ""


def json_documents(path, column):
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        is_list = path.endswith(".json") and f.read(4096).lstrip().startswith("[")
    if is_list:
        for i, record in enumerate(parse_json("".join(utf8_lines(path)), path)):
            yield text_field(record, column, f"{path}[{i}]")
        return
    for lineno, line in enumerate(utf8_lines(path), 1):  # .jsonl, or a .json of JSON lines
        if line.strip():
            where = f"{path}:{lineno}"
            yield text_field(parse_json(line, where), column, where)


def check_arrow_column(schema, column, where):
    kind = schema.field(column).type if column in schema.names else None
    if kind is None or not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        has = ", ".join(f"{f.name} ({f.type})" for f in schema)
        raise UserError(f"{where} has no text column {column!r} (it has: {has}): pass "
                           f"--text_column=<the column that holds the text>.")


def arrow_documents(batches, column):
    for batch in batches:
        yield from (text or "" for text in batch.column(column).to_pylist())


def parquet_documents(path, column):
    try:
        f = pq.ParquetFile(path)
        check_arrow_column(f.schema_arrow, column, path)
        yield from arrow_documents(f.iter_batches(batch_size=1024, columns=[column]), column)
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"{path} could not be read as parquet ({e}).") from e


def file_documents(path, column):
    if path.endswith(".txt"):
        yield "".join(utf8_lines(path))
    elif path.endswith(".parquet"):
        yield from parquet_documents(path, column)
    else:
        yield from json_documents(path, column)


def python_source(path):
    """A .py file decoded the way Python reads source (coding cookie, else UTF-8); None for the
    few files the stdlib ships undecodable on purpose (test/tokenizedata/bad_coding.py)."""
    try:
        with tokenize.open(path) as f:
            return f.read()
    except (SyntaxError, UnicodeDecodeError):
        return None


def stdlib_files(root):
    files = sorted(os.path.relpath(p, root) for p in glob.glob(f"{root}/**/*.py", recursive=True))
    return [os.path.join(root, p) for p in files
            if not {"site-packages", "dist-packages"} & set(p.split(os.sep))]


def local_files(dataset):
    if not (os.path.exists(dataset) or glob.has_magic(dataset)):
        raise UserError(f"--dataset={dataset!r} does not exist: check the path (relative "
                           f"paths start at {os.getcwd()}).")
    pattern = os.path.join(dataset, "**", "*") if os.path.isdir(dataset) else dataset
    files = [p for p in sorted(glob.glob(pattern, recursive=True))
             if os.path.isfile(p) and p.endswith(EXTENSIONS)]
    if not files:
        raise UserError(f"--dataset={dataset!r} matches no {', '.join(EXTENSIONS)} files, and "
                           f"is no copy of OpenWebText's archives (subsets/{OWT_GLOB}): check "
                           f"the path (relative paths start at {os.getcwd()}).")
    return files


def local_name(dataset):
    """A file's stem, a folder's name, or for a glob the folder it starts in."""
    if glob.has_magic(dataset):
        dataset = os.path.dirname(re.split(r"[*?[]", dataset)[0])
    path = os.path.abspath(dataset or ".")
    return os.path.basename(path) if os.path.isdir(path) else \
        os.path.splitext(os.path.basename(path))[0]


def hub_dataset(name, column):
    import datasets  # slow to import, and only needed here
    # datasets>=4 runs no dataset scripts, but the hub's parquet export of a scripted dataset
    # (OpenWebText is one) loads; datasets that are parquet already have no export
    errors = []
    for revision in ("refs/convert/parquet", None):
        try:
            builder = datasets.load_dataset_builder(name, revision=revision)
            builder.download_and_prepare()
            ds = builder.as_dataset(split="train")
            break
        except Exception as e:
            errors.append(f"{revision or 'default branch'}: {type(e).__name__}: {e}")
    else:
        raise UserError(
            f"--dataset={name!r} is not a file, folder or glob match here, and the datasets "
            f"library could not load it from the Hugging Face hub ({'; '.join(errors)}). Hub "
            f"datasets need network access the first time (then they are cached): check the "
            f"name and the network, or pass a local {'/'.join(EXTENSIONS)} file, folder or "
            f"glob, or --dataset=pystdlib, which needs no network.")
    if any("partial-" in f for f in (builder.config.data_files or {}).get("train", [])):
        print(f"prepare.py: warning: the hub's parquet export of {name} is partial: it holds "
              f"only the start of its train split (exports stop at about 5 GB), and so will the "
              f"token files. For all of it, download the dataset's own files with `hf download "
              f"{name} --repo-type dataset --local-dir DIR` and pass --dataset=DIR: prepare.py "
              f"reads the {'/'.join(EXTENSIONS)} files in it.", file=sys.stderr)
    check_arrow_column(ds.data.schema, column, f"hub dataset {name!r}")
    # the Arrow table is memory-mapped: reading it in slices never holds all the text
    return ds.select_columns([column]).with_format("arrow")


# ---- OpenWebText: 21 tars of .xz files, each an xz-compressed tar of .txt documents ----

OWT_REPO = "Skylion007/openwebtext"  # a dataset repository on the Hugging Face hub
OWT_ARCHIVES = [f"subsets/urlsf_subset{i:02d}.tar" for i in range(21)]
OWT_GLOB = "urlsf_subset*.tar"
OWT_DOCUMENTS = 8_013_769  # .txt files in the 21 archives, as the hub's loading script counts


def download_openwebtext():
    """The 21 archives in the Hugging Face cache, downloaded the first time (about 13 GB,
    resumable); with HF_HUB_OFFLINE=1 the cache only."""
    import huggingface_hub  # only this source needs it
    paths = []
    for filename in tqdm(OWT_ARCHIVES, desc="OpenWebText archives", unit=" archives"):
        try:
            paths.append(huggingface_hub.hf_hub_download(OWT_REPO, filename,
                                                         repo_type="dataset"))
        except OSError as e:  # every hub error is one, not-cached-and-offline included
            reason = " ".join(str(e).split())  # the hub's messages span lines
            raise UserError(
                f"could not get {filename} of the hub dataset {OWT_REPO} ({reason}). The "
                f"first run downloads OpenWebText's 21 archives (about 13 GB) into the Hugging "
                f"Face cache ({huggingface_hub.constants.HF_HUB_CACHE}) and needs the network; "
                f"later runs read the cache, offline too. Without the network here, "
                f"download the archives where there is one with `hf download {OWT_REPO} "
                f"--repo-type dataset --include 'subsets/*' --local-dir DIR`, copy DIR here and "
                f"pass --dataset=DIR.") from e
    return paths


def local_archives(dataset):
    """The archives of a copy of OpenWebText: urlsf_subset*.tar in <dataset>/subsets (where
    `hf download --local-dir` puts them) or in <dataset> itself; [] for anything else."""
    for folder in (os.path.join(dataset, "subsets"), dataset):
        archives = sorted(glob.glob(os.path.join(glob.escape(folder), OWT_GLOB)))
        if archives:
            return archives
    return []


def tar_members(tar, suffix):
    """(name, file) of a streamed tar's files named *suffix, skipping what the hub's loading
    script skipped (through datasets' iter_archive): anything but regular files, and hidden
    ones (.* and __*)."""
    for member in tar:
        base = os.path.basename(member.name)
        if member.isreg() and base.endswith(suffix) and not base.startswith((".", "__")):
            yield member.name, tar.extractfile(member)


def check_tar_end(tar, path):
    """tarfile ends a streamed archive quietly at a damaged header, or where the file is cut
    off: only an end-of-archive (zero) block where it stopped (tar.offset) shows that nothing
    was lost."""
    with open(path, "rb") as f:
        f.seek(tar.offset)
        if f.read(tarfile.BLOCKSIZE) != bytes(tarfile.BLOCKSIZE):
            raise tarfile.ReadError(f"reading stopped at byte {tar.offset:,}, where there is "
                                    f"a damaged header or the end of a cut-off file")


def owt_text(data, where):
    """A .txt member as the hub's loading script made it a document."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{where} is not UTF-8 text ({e}): the archive is not OpenWebText's "
                        f"own.") from e
    return re.sub("\n\n\n+", "\n\n", text).strip()


def archive_documents(path):
    """The documents of one archive, in member order, streamed: memory does not grow with it.
    Each .xz is read with lzma, not tarfile's "r|xz", which takes an .xz cut off near a member
    boundary for the end of its tar; lzma raises EOFError there."""
    where = path
    try:
        with tarfile.open(path, "r|") as outer:
            for xz_name, xz_file in tar_members(outer, ".xz"):
                where = f"{path}, member {xz_name},"
                with lzma.open(xz_file) as xz:
                    with tarfile.open(fileobj=xz, mode="r|") as inner:
                        for txt_name, txt_file in tar_members(inner, ".txt"):
                            yield owt_text(txt_file.read(), f"{path}: {xz_name}: {txt_name}")
                    while xz.read(1 << 16):  # on to the end marker, which a cut-off .xz lacks
                        pass
                where = path
            check_tar_end(outer, path)
    except (tarfile.TarError, lzma.LZMAError, EOFError) as e:  # not OSError: main() says it
        name = os.path.basename(path)
        raise UserError(
            f"{where} is damaged ({type(e).__name__}: {e}): the archive is cut off or corrupt. "
            f"Replace it with a good copy: `hf download {OWT_REPO} subsets/{name} --repo-type "
            f"dataset --force-download` downloads it again (into the cache that prepare.py "
            f"reads; add --local-dir DIR for a copy in DIR/subsets).") from e


def openwebtext_source(name, archives, num_proc):
    return name, f"OpenWebText, {len(archives)} archives in {os.path.dirname(archives[0])}", \
        lambda: (text for path in archives for text in archive_documents(path)), \
        lambda: count_archives(archives, num_proc)


def open_source(dataset, column, num_proc):
    """(default folder name, a description, a function that yields the documents, a function
    that counts them)."""
    if dataset in ("openwebtext", OWT_REPO) and not os.path.exists(dataset):
        return openwebtext_source("openwebtext", download_openwebtext(), num_proc)
    if archives := local_archives(dataset):
        return openwebtext_source(local_name(dataset), archives, num_proc)
    name, source, documents = text_source(dataset, column)
    return name, source, documents, lambda: count_documents(documents)


def text_source(dataset, column):
    """(default folder name, a description, a function that yields the documents)."""
    if dataset == "pystdlib":
        root = sysconfig.get_paths()["stdlib"]
        files = stdlib_files(root)
        return "pystdlib", f"{len(files)} .py files of {root}", lambda: map(python_source, files)
    if os.path.exists(dataset) or glob.has_magic(dataset) or dataset.endswith(EXTENSIONS):
        files = local_files(dataset)
        return local_name(dataset), f"{dataset}, {len(files)} file(s)", \
            lambda: (doc for path in files for doc in file_documents(path, column))
    ds = hub_dataset(dataset, column)
    return dataset.split("/")[-1], f"hub dataset {dataset} ({len(ds):,} rows)", \
        lambda: arrow_documents(ds.iter(batch_size=1024), column)


# ---- tokenizing: pass 1 counts the documents, pass 2 encodes them in a pool of workers ----

def is_document(text):
    return bool(text) and not text.isspace()


def tally(texts):
    """Non-empty documents, empty ones, and files that could not be decoded (None)."""
    n = {"documents": 0, "empty": 0, "undecodable": 0}
    for text in texts:
        if text is None:
            n["undecodable"] += 1
        elif is_document(text):
            n["documents"] += 1
        else:
            n["empty"] += 1
    return n


def count_documents(documents):
    return tally(tqdm(documents(), desc="counting documents", unit=" docs"))


def count_archive(path):
    return tally(archive_documents(path))


def count_archives(archives, num_proc):
    """count_documents for OpenWebText, one archive per process: decompressing is the work."""
    counts = Counter()
    with Pool(min(num_proc, len(archives)), ignore_sigint) as pool, \
            tqdm(total=len(archives), desc="counting documents", unit=" archives") as bar:
        for n in pool.imap(count_archive, archives):  # in order: the first damaged one is named
            counts.update(n)
            bar.set_postfix(documents=f"{counts['documents']:,}")
            bar.update()
    report_openwebtext_total(counts["documents"] + counts["empty"], archives)
    return counts


def report_openwebtext_total(total, archives):
    print(f"OpenWebText: {total:,} documents (.txt files) in {len(archives)} archives")
    if total != OWT_DOCUMENTS:
        missing = sorted({os.path.basename(a) for a in OWT_ARCHIVES} -
                         {os.path.basename(a) for a in archives})
        print(f"prepare.py: warning: OpenWebText is {OWT_DOCUMENTS:,} documents in "
              f"{len(OWT_ARCHIVES)} archives (urlsf_subset00.tar to urlsf_subset20.tar), but "
              f"the archives read here hold {total:,} (missing archives: "
              f"{', '.join(missing) or 'none'}). They are a partial download or copy, or "
              f"upstream changed them; the token files will hold only these documents, and "
              f"the README's expected numbers do not apply.", file=sys.stderr)


def validation_size(args, n_docs, source):
    if n_docs == 0:
        raise UserError(f"the corpus ({source}) holds no non-empty documents: check "
                           f"--dataset and --text_column.")
    if n_docs == 1:
        raise UserError(f"the corpus ({source}) is a single document (a .txt file is one "
                           f"document), which cannot be split into training and validation "
                           f"data: pass several files (a folder or a glob), or a .jsonl file "
                           f"with one document per line.")
    if not 0 <= args.val_fraction < 1:
        raise UserError(f"--val_fraction={args.val_fraction} is not in [0, 1).")
    n_val = args.val_docs if args.val_docs is not None else \
        max(1, round(n_docs * args.val_fraction))
    if not 1 <= n_val < n_docs:
        raise UserError(f"{n_val} validation documents out of the corpus's {n_docs} non-empty "
                           f"ones ({source}) leave no training or no validation data: pass a "
                           f"--val_docs or --val_fraction that keeps 1 to {n_docs - 1} documents "
                           f"for validation.")
    return n_val


def chunks(texts, n_docs, n_val, key):
    """(texts, which of them go to val), about CHUNK_CHARS characters at a time. Document d
    (non-empty documents counted from 0 in corpus order) goes to val iff
    permute(d, n_docs, key) < n_val: the split is a function of the seed and needs no memory."""
    batch, size, first = [], 0, 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= CHUNK_CHARS:
            yield batch, in_val(first, len(batch), n_docs, n_val, key)
            first += len(batch)
            batch, size = [], 0
    if batch:
        yield batch, in_val(first, len(batch), n_docs, n_val, key)


def in_val(first, count, n_docs, n_val, key):
    return (data.permute(np.arange(first, first + count), n_docs, key) < n_val).tolist()


_tokenizer = None  # each worker's own


def ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the main process to handle


def init_worker(tokenizer_name):
    ignore_sigint()
    global _tokenizer
    _tokenizer = get_tokenizer(tokenizer_name)


def encode_chunk(task):
    """{split: (its tokens, its number of documents)} for one chunk."""
    texts, in_val = task
    ids = {split: [] for split in tokenfile.SPLITS}
    for text, is_val in zip(texts, in_val):
        split = "val" if is_val else "train"
        ids[split].extend(_tokenizer.encode(text))
        ids[split].append(_tokenizer.eot)
    dtype = tokenfile.token_dtype(_tokenizer.vocab_size)
    return {split: (np.array(ids[split], dtype=dtype), in_val.count(split == "val"))
            for split in tokenfile.SPLITS}


def ordered_map(pool, fn, items, ahead):
    """pool.imap, reading at most `ahead` items ahead of the results: imap's feeder thread
    would pull the whole corpus into memory whenever reading is faster than encoding."""
    pending = deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= ahead:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def write_tokens(files, texts, n_docs, n_val, args):
    """Append each chunk's tokens to the split's file; the documents of each split."""
    documents = dict.fromkeys(tokenfile.SPLITS, 0)
    work = chunks(texts, n_docs, n_val, data.hash_key(args.seed))
    with Pool(args.num_proc, init_worker, (args.tokenizer,)) as pool, \
            tqdm(total=n_docs, desc="tokenizing", unit=" docs") as bar:
        for result in ordered_map(pool, encode_chunk, work, ahead=2 * args.num_proc):
            for split, (ids, n) in result.items():
                ids.tofile(files[split])
                documents[split] += n
                bar.update(n)
    return documents


# ---- output: .tmp files, renamed to their final names when complete, meta.json last ----

def open_outputs(out_dir):
    try:
        os.makedirs(out_dir, exist_ok=True)
        return {s: open(os.path.join(out_dir, f"{s}.bin.tmp"), "wb") for s in tokenfile.SPLITS}
    except OSError as e:
        raise UserError(f"cannot write to --out_dir={out_dir} ({e}): pass an --out_dir "
                           f"that you can create and write files in.") from e


def publish_outputs(out_dir, files, documents, tokenizer, provenance):
    """Rename the complete .tmp files and write meta.json, which vouches for them, last."""
    old_meta = os.path.join(out_dir, tokenfile.META_NAME)
    if os.path.exists(old_meta):  # it vouches for the old files: it goes before they change
        os.remove(old_meta)
    splits = {}
    for split, f in files.items():
        path = os.path.join(out_dir, f"{split}.bin")
        fileio.publish(f.name, path)
        splits[split] = tokenfile.describe_split(path, tokenfile.token_dtype(
            tokenizer.vocab_size), documents[split])
    tokenfile.write_meta(out_dir, tokenizer=tokenizer.name, vocab_size=tokenizer.vocab_size,
                         eot_token=tokenizer.eot, splits=splits, **provenance)
    return splits


def prepare(args):
    if args.num_proc < 1:
        raise UserError(f"--num_proc={args.num_proc}: use at least 1 process.")
    tokenizer = get_tokenizer(args.tokenizer)
    name, source, documents, count = open_source(args.dataset, args.text_column, args.num_proc)
    counts = count()
    n_val = validation_size(args, counts["documents"], source)
    out_dir = args.out_dir or os.path.join("data", name)
    files = open_outputs(out_dir)
    try:
        documents_per_split = write_tokens(files, filter(is_document, documents()),
                                           counts["documents"], n_val, args)
        for f in files.values():
            f.close()
        stats = publish_outputs(out_dir, files, documents_per_split, tokenizer, {
            "source": args.dataset, "source_detail": source, "text_column": args.text_column,
            "val_selection": f"non-empty document d (from 0, in corpus order) is in val iff "
                             f"data.permute(d, {counts['documents']}, data.hash_key({args.seed}))"
                             f" < {n_val}",
            "seed": args.seed, "skipped_empty_documents": counts["empty"],
            "skipped_undecodable_files": counts["undecodable"]})
    except BaseException:
        for f in files.values():
            f.close()
            if os.path.exists(f.name):
                os.remove(f.name)
        raise
    return out_dir, stats, counts


def parse_args():
    p = argparse.ArgumentParser(
        description="Tokenize a corpus into train.bin, val.bin and meta.json (format: "
                    "tokenfile.py): each non-empty document followed by end-of-text; empty ones are skipped.")
    p.add_argument("--dataset", default="openwebtext", help=(
        "'openwebtext': all of OpenWebText, its 21 archives from the hub repository "
        f"{OWT_REPO} (about 13 GB, downloaded to the Hugging Face cache the first time), or "
        "a folder holding a copy of them (subsets/urlsf_subset*.tar); another Hugging Face hub "
        "dataset (its train split; needs network the first time); local files: a .txt file "
        "(one document), .jsonl (an object per line), .json (a list of objects, or JSON lines "
        "if it does not start with '['), .parquet (a document per row), a folder (all such "
        "files in it, recursively, sorted) or a quoted glob; or 'pystdlib': the .py files of "
        "this Python's standard library, a document each, no network needed. "
        "Default: %(default)s"))
    p.add_argument("--text_column", default="text",
                   help="the field or column that holds the text (default: %(default)s)")
    p.add_argument("--out_dir", help="default: data/<dataset name, or file or folder stem>")
    p.add_argument("--tokenizer", default="gpt2",
                   help="a tiktoken encoding, or 'byte' (default: %(default)s)")
    val = p.add_mutually_exclusive_group()
    val.add_argument("--val_fraction", type=float, default=0.0005,
                     help="fraction of the documents for validation, rounded, at least "
                          "one document (default: %(default)s)")
    val.add_argument("--val_docs", type=int, help="number of documents for validation")
    p.add_argument("--seed", type=int, default=2357,
                   help="chooses the validation documents (default: %(default)s)")
    p.add_argument("--num_proc", type=int, default=os.cpu_count(),
                   help="tokenizer processes, and for OpenWebText the processes that count "
                        "its archives' documents (default: one per core, %(default)s)")
    return p.parse_args()


def main():
    args = parse_args()
    t0 = time.time()
    try:
        out_dir, stats, counts = prepare(args)
    except (UserError, OSError) as e:
        sys.exit(f"prepare.py: error: {e}")
    except KeyboardInterrupt:
        sys.exit("prepare.py: interrupted; no new output was published.")
    elapsed = time.time() - t0
    for s in tokenfile.SPLITS:
        path = os.path.join(out_dir, f"{s}.bin")
        print(f"{s:5s}: {stats[s]['tokens']:,} tokens, {stats[s]['documents']:,} documents -> "
              f"{path} ({os.path.getsize(path) / 1e6:.1f} MB)")
    print(f"meta : {os.path.join(out_dir, tokenfile.META_NAME)}")
    print(f"skipped {counts['empty']:,} empty documents, {counts['undecodable']:,} undecodable "
          f"files; {sum(stats[s]['tokens'] for s in tokenfile.SPLITS) / elapsed:,.0f} tokens/s, "
          f"{elapsed:.1f} s in all")


if __name__ == "__main__":
    main()
