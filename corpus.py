"""Corpora as documents: every source prepare.py reads, as a function that yields one string
per document (None for a file that cannot be decoded), and a function that counts them.

  local files     .txt (a document per file), .jsonl / .json (a document per object),
                  .parquet (a document per row); a file, a folder (recursively) or a glob
  pystdlib        the .py files of this Python's standard library, no network needed
  openwebtext     all of OpenWebText: its 21 archives from the hub, or a local copy of them
  a hub name      another Hugging Face hub dataset's train split (its parquet export), or
                  with streaming=True its train split streamed, never stored (corpora larger
                  than the disk; each pass streams it again); local .parquet files stream too
"""
import glob
import json
import lzma
import os
import re
import signal
import sys
import sysconfig
import tarfile
import tokenize
from collections import Counter
from multiprocessing import Pool

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from errors import UserError

EXTENSIONS = (".txt", ".jsonl", ".json", ".parquet")


# ---- local files and the standard library ----

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


def open_source(dataset, column, num_proc, streaming=False, hub_config=None):
    """(default folder name, a description, a function that yields the documents, a function
    that counts them)."""
    if streaming:
        name, source, documents = streamed_source(dataset, hub_config, column)
        return name, source, documents, lambda: count_documents(documents)
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


def streamed_source(dataset, hub_config, column):
    """A hub dataset's train split, or local .parquet files, streamed by the datasets library:
    rows are read as they arrive and nothing is stored, so a corpus larger than the disk's free
    space can be tokenized (each of prepare.py's two passes streams it once)."""
    import datasets  # slow to import, and only needed here
    local = os.path.exists(dataset) or glob.has_magic(dataset)
    try:
        if local:
            files = [p for p in local_files(dataset) if p.endswith(".parquet")]
            if not files:
                raise UserError(f"--streaming reads local .parquet files only; --dataset="
                                f"{dataset!r} has none: drop --streaming to read it.")
            ds = datasets.load_dataset("parquet", data_files=files, split="train",
                                       streaming=True)
        else:
            ds = datasets.load_dataset(dataset, hub_config, split="train", streaming=True)
        first = next(iter(ds.take(1)), {})
    except UserError:
        raise
    except Exception as e:  # the hub's and the network's errors are many kinds
        raise UserError(
            f"--dataset={dataset!r} could not be streamed ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:300]}): check the name, --hub_config (a dataset's "
            f"subset, such as sample-10BT of HuggingFaceFW/fineweb-edu) and the network.") from e
    text_field(first, column, f"the first row of {dataset}")
    name = local_name(dataset) if local else (hub_config or dataset.split("/")[-1])
    return name, f"{dataset}{f' ({hub_config})' if hub_config else ''}, streamed", \
        lambda: (row[column] or "" for row in ds)


# ---- pass 1: counting the documents ----

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
    with Pool(min(num_proc, len(archives)), worker_signals) as pool, \
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


def worker_signals():
    """A worker process leaves stopping to the main process (prepare.py's Interrupted), which
    terminates it: it ignores Ctrl-C and a closed terminal, which reach the whole process
    group, and dies of SIGTERM quietly, without the handler it inherited."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
