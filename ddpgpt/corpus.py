"""Corpora as documents: every corpus prepare.py reads, as a Corpus: a function that yields one
string per document (None for a file that cannot be decoded), and a function that counts them.
docs/data.md lists them: local files (a file, a folder or a glob), pystdlib, OpenWebText, and
another hub dataset's train split (its parquet export, or streamed)."""
import glob
import hashlib
import io
import itertools
import json
import lzma
import os
import re
import stat
import sys
import sysconfig
import tarfile
import tokenize
from collections import Counter
from typing import Callable, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from ddpgpt import fileio, tokenfile, workers
from ddpgpt.errors import UserError

EXTENSIONS = (".txt", ".jsonl", ".json", ".parquet")
AS_TEXT = ("to read files of another kind as text, name them with a glob: "
           "--dataset='<folder>/**/*.md'")
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd"}  # not for .parquet


# ---- local files and the standard library ----

def document_kind(path):
    """(kind, compression) of a file prepare.py reads, by its name in any case: ('.jsonl',
    '.gz') for docs.JSONL.gz, ('.txt', '') for a.txt; None for any other file."""
    stem, ext = os.path.splitext(os.path.basename(path).lower())
    compression = ext if ext in COMPRESSIONS else ""
    if compression:
        stem, ext = os.path.splitext(stem)
    readable = ext in EXTENSIONS and not (compression and ext == ".parquet")
    return (ext, compression) if readable else None


def open_text(path, compression):
    # newline="" keeps the text exactly as it is in the file, \r\n included
    if not compression:
        return open(path, encoding="utf-8-sig", newline="")
    raw = lzma.open(path) if compression == ".xz" else \
        pa.input_stream(path, compression=COMPRESSIONS[compression])
    return io.TextIOWrapper(raw, encoding="utf-8-sig", newline="")


def text_kind(path):
    """document_kind, where a file of another kind that a glob named is plain text."""
    return document_kind(path) or (".txt", "")


def utf8_lines(path):
    compression = text_kind(path)[1]
    try:
        with open_text(path, compression) as f:
            yield from f
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text ({e}): convert it to UTF-8 (e.g. with "
                           f"iconv) or move it out of the corpus.") from e
    except (OSError, EOFError, lzma.LZMAError) as e:
        if not compression:
            raise  # a read error of the disk: main() says it
        raise UserError(f"{path} could not be decompressed ({type(e).__name__}: {e}): it is "
                        f"damaged or cut off. Replace it with a good copy, or move it out of "
                        f"the corpus.") from e


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


def json_documents(path, column, kind):
    """The documents of a .jsonl, or of a .json: a list of objects, or JSON lines too."""
    lines = enumerate(utf8_lines(path), 1)
    first = next(((n, line) for n, line in lines if line.strip()), (0, ""))
    if kind == ".json" and first[1].lstrip().startswith("["):
        text = first[1] + "".join(line for _, line in lines)
        for i, record in enumerate(parse_json(text, path)):
            yield text_field(record, column, f"{path}[{i}]")
        return
    for lineno, line in itertools.chain([first], lines):  # (0, '') for a blank file: skipped
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


def file_documents(path, column):
    kind, _ = text_kind(path)
    if kind == ".txt":
        yield "".join(utf8_lines(path))
    elif kind == ".parquet":
        try:
            f = pq.ParquetFile(path)
            check_arrow_column(f.schema_arrow, column, path)
            yield from arrow_documents(f.iter_batches(batch_size=1024, columns=[column]), column)
        except (OSError, pa.ArrowException) as e:
            raise UserError(f"{path} could not be read as parquet ({e}).") from e
    else:
        yield from json_documents(path, column, kind)


def python_source(path):
    """A .py file decoded the way Python reads source (coding cookie, else UTF-8); None for the
    few files the stdlib ships undecodable on purpose (test/tokenizedata/bad_coding.py)."""
    try:
        with tokenize.open(path) as f:
            return f.read()
    except (SyntaxError, UnicodeDecodeError):
        return None


# What a corpus folder can hold besides its documents: prepare.py skips them, a line per kind.
SKIPPED = {
    "hidden": "hidden files and folders (names that start with '.': .git, .DS_Store, editor "
              "swap files .*.swp, ...)",
    "macos": "__MACOSX folders (macOS's archive metadata, not documents)",
    "backup": "editor backup files (*~, #*#)",
    "output": "folders of token files that prepare.py wrote (its meta.json, progress file or "
              "lock are not documents)",
    "unreadable": "broken symlinks and symlink loops",
    "repeat": "files or folders reached again through a symlink (each is read once)",
    "special": "things that are not regular files (FIFOs, sockets, devices)",
    "other": f"files of other kinds (prepare.py reads {', '.join(EXTENSIONS)}, the first "
             f"three also compressed {', '.join(COMPRESSIONS)}; {AS_TEXT})",
    "empty": "empty files (0 bytes)",
}


def local_files(dataset):
    """The document files of a file, a folder (recursively, symlinks followed) or a glob,
    sorted, each real file once; what else there is is skipped, a line per kind."""
    if not (os.path.exists(dataset) or glob.has_magic(dataset)):
        raise UserError(f"--dataset={dataset!r} does not exist: check the path (relative "
                           f"paths start at {os.getcwd()}).")
    skipped, seen = {kind: [] for kind in SKIPPED}, set()
    if os.path.isdir(dataset):
        if prepared_output(dataset):
            raise UserError(f"--dataset={dataset!r} holds token files that prepare.py wrote "
                            f"(its {tokenfile.META_NAME}, progress file or lock), not a "
                            f"corpus: pass the folder of the documents. train.py reads this "
                            f"one as its data_dir.")
        found = walk(dataset, skipped, seen)
    else:
        as_text = re.search(r"\.\w+$", dataset) and document_kind(dataset) is None
        found = [p for p in glob.glob(dataset, recursive=True) if not os.path.isdir(p)
                 and not skip(p, os.path.basename(p), skipped, seen, False, as_text)]
    for kind, paths in skipped.items():
        if paths:
            names = ", ".join(paths[:3]) + (", ..." if len(paths) > 3 else "")
            print(f"prepare.py: skipped {SKIPPED[kind]}: {len(paths)} ({names})")
    if not found:
        raise UserError(f"--dataset={dataset!r} matches no {', '.join(EXTENSIONS)} files, and "
                           f"is no copy of OpenWebText's archives (subsets/{OWT_GLOB}): check "
                           f"the path (relative paths start at {os.getcwd()}); {AS_TEXT}.")
    return sorted(found)


def walk(folder, skipped, seen):
    """The document files under folder. seen holds the folders and files met so far (device
    and inode), so that a symlink loop ends, and a file linked twice is read once."""
    seen.add(identity(os.stat(folder)))
    found = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if not skip(entry.path, entry.name, skipped, seen, by_name=True):
            found += walk(entry.path, skipped, seen) if os.path.isdir(entry.path) else [entry.path]
    return found


def skip(path, name, skipped, seen, by_name, as_text=False):
    """Is path no document of the corpus? If so, it goes into skipped under its kind. Hidden,
    macOS and backup names count in folders only (by_name): a glob that names them means them,
    as a glob of another extension means those files, as text (as_text)."""
    if kind := kind_of(path, name, seen, by_name, as_text):
        skipped[kind].append(path)
    return kind is not None


def kind_of(path, name, seen, by_name, as_text=False):
    """The SKIPPED kind of path, or None for a folder to read or a document file."""
    if by_name and (name.startswith(".") or name == "__MACOSX"):
        return "hidden" if name.startswith(".") else "macos"
    if by_name and (name.endswith("~") or (name.startswith("#") and name.endswith("#"))):
        return "backup"
    try:
        info = os.stat(path)  # of what a symlink points to
    except OSError:  # a broken symlink (ENOENT) or a symlink loop (ELOOP)
        return "unreadable"
    if stat.S_ISDIR(info.st_mode):
        return "repeat" if identity(info) in seen else "output" if prepared_output(path) else None
    if not stat.S_ISREG(info.st_mode):
        return "special"
    if document_kind(path) is None and not as_text:
        return "other"
    if not by_name and prepared_output(os.path.dirname(path) or "."):
        return "output"
    if identity(info) in seen:
        return "repeat"
    seen.add(identity(info))
    return "empty" if info.st_size == 0 else None


def identity(info):
    """A file or folder, whatever the path to it: its device and inode."""
    return info.st_dev, info.st_ino


def prepared_output(folder):
    """Does folder hold prepare.py's output: its progress file, its lock, or ddpgpt's
    meta.json (with a format_version)? Those .json files are not documents."""
    if any(os.path.exists(os.path.join(folder, name))
           for name in (tokenfile.PROGRESS_NAME, fileio.LOCK_NAME)):
        return True
    try:
        with open(os.path.join(folder, tokenfile.META_NAME)) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "format_version" in meta


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
    """The 21 archives in the Hugging Face cache, downloaded the first time (about 13 GB)."""
    import huggingface_hub  # only this source needs it
    paths = []
    for filename in tqdm(OWT_ARCHIVES, desc="OpenWebText archives", unit=" archives"):
        try:
            paths.append(huggingface_hub.hf_hub_download(OWT_REPO, filename, repo_type="dataset"))
        except OSError as e:  # every hub error is one, not-cached-and-offline included
            reason = " ".join(str(e).split())  # the hub's messages span lines
            raise UserError(
                f"could not get {filename} of the hub dataset {OWT_REPO} ({reason}). The first run "
                f"downloads OpenWebText's 21 archives (about 13 GB) into the Hugging Face cache "
                f"({huggingface_hub.constants.HF_HUB_CACHE}) and needs the network; later runs "
                f"read the cache, offline too. Without the network here, download the archives "
                f"where there is one with `hf download {OWT_REPO} --repo-type dataset --include "
                f"'subsets/*' --local-dir DIR`, copy DIR here and pass --dataset=DIR.") from e
    return paths


def local_archives(dataset):
    """The archives of a copy of OpenWebText, in <dataset>/subsets or <dataset>; else []."""
    for folder in (os.path.join(dataset, "subsets"), dataset):
        if archives := sorted(glob.glob(os.path.join(glob.escape(folder), OWT_GLOB))):
            return archives
    return []


def tar_members(tar, suffix):
    """(name, file) of a streamed tar's files named *suffix, skipping what the hub's loading
    script skipped: anything but regular files, and hidden ones (.* and __*)."""
    for member in tar:
        base = os.path.basename(member.name)
        if member.isreg() and base.endswith(suffix) and not base.startswith((".", "__")):
            yield member.name, tar.extractfile(member)


def check_tar_end(tar, path):
    """tarfile ends a streamed archive quietly at a damaged header or a cut-off end: only a
    zero block where it stopped (tar.offset) shows that nothing was lost."""
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


class Corpus(NamedTuple):
    name: str  # the default output folder's name: data/<name>
    description: str  # what it is, for the log and meta.json
    documents: Callable  # () -> an iterator of the documents, in corpus order
    count: Callable  # () -> {"documents": non-empty ones, "empty": ..., "undecodable": ...}
    identity: str = ""  # files_identity, for a resume to see a change; '' for a streamed one


def files_identity(paths):
    """A corpus of files as a resumed prepare compares it: each file's path, size and
    modification time (reading them would cost a whole pass)."""
    h = hashlib.blake2b(digest_size=16)
    for path in paths:
        info = os.stat(path)
        h.update(f"{os.path.abspath(path)}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
    return f"{len(paths)} files, {h.hexdigest()}"


def openwebtext_corpus(name, archives, num_proc):
    return Corpus(name, f"OpenWebText, {len(archives)} archives in {os.path.dirname(archives[0])}",
                  lambda: (text for path in archives for text in archive_documents(path)),
                  lambda: count_archives(archives, num_proc), files_identity(archives))


def open_corpus(dataset, column, num_proc, streaming=False, hub_config=""):
    """The Corpus that --dataset names."""
    if streaming:
        return streamed_corpus(dataset, hub_config, column)
    if dataset in ("openwebtext", OWT_REPO) and not os.path.exists(dataset):
        return openwebtext_corpus("openwebtext", download_openwebtext(), num_proc)
    if archives := local_archives(dataset):
        return openwebtext_corpus(local_name(dataset), archives, num_proc)
    return text_corpus(dataset, column)


def counted(name, description, documents, identity="", names=None):
    """A Corpus whose documents are counted by reading them all once (names: see tally)."""
    return Corpus(name, description, documents, lambda: tally(
        tqdm(documents(), desc="counting documents", unit=" docs"), names), identity)


def text_corpus(dataset, column):
    """The standard library, local files, or a hub dataset's parquet export."""
    if dataset == "pystdlib":
        root = sysconfig.get_paths()["stdlib"]
        found = glob.glob(f"{root}/**/*.py", recursive=True)
        files = [os.path.join(root, p) for p in sorted(os.path.relpath(p, root) for p in found)
                 if not {"site-packages", "dist-packages"} & set(p.split(os.sep))]
        return counted("pystdlib", f"{len(files)} .py files of {root}",
                       lambda: map(python_source, files), files_identity(files),
                       [os.path.relpath(p, root) for p in files])
    if os.path.exists(dataset) or glob.has_magic(dataset) or dataset.endswith(EXTENSIONS):
        files = local_files(dataset)
        return counted(local_name(dataset), f"{dataset}, {len(files)} file(s)",
                       lambda: (doc for path in files for doc in file_documents(path, column)),
                       files_identity(files))
    ds = hub_dataset(dataset, column)
    return counted(dataset.split("/")[-1], f"hub dataset {dataset} ({len(ds):,} rows)",
                   lambda: arrow_documents(ds.iter(batch_size=1024), column),
                   f"{len(ds)} rows, {ds.info.download_checksums}")


def streamed_corpus(dataset, hub_config, column):
    """A hub dataset's train split, or local .parquet files, streamed by the datasets library:
    nothing is stored, so a corpus larger than the free disk space can be tokenized."""
    import datasets  # slow to import, and only needed here
    local = os.path.exists(dataset) or glob.has_magic(dataset)
    try:
        if local:
            files = [p for p in local_files(dataset) if document_kind(p) == (".parquet", "")]
            if not files:
                raise UserError(f"--streaming reads local .parquet files only; --dataset="
                                f"{dataset!r} has none: drop --streaming to read it.")
            ds = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
        else:
            ds = datasets.load_dataset(dataset, hub_config or None, split="train", streaming=True)
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
    return counted(name, f"{dataset}{f' ({hub_config})' if hub_config else ''}, streamed",
                   lambda: (row[column] or "" for row in ds),
                   files_identity(files) if local else "")


# ---- pass 1: counting the documents ----

def is_document(text):
    return bool(text) and not text.isspace()


NAMED = 3  # undecodable files named in prepare.py's summary; the rest are "..."


def tally(texts, names=None):
    """Non-empty documents, empty ones, and files that could not be decoded (None); with names
    (one per text), the names of the first few undecodable ones too."""
    n = {"documents": 0, "empty": 0, "undecodable": 0}
    undecodable = []
    for i, text in enumerate(texts):
        kind = "undecodable" if text is None else "documents" if is_document(text) else "empty"
        n[kind] += 1
        if kind == "undecodable" and names is not None and len(undecodable) <= NAMED:
            undecodable.append(names[i])
    return {**n, "undecodable_files": undecodable} if undecodable else n


def count_archive(path):
    return tally(archive_documents(path))


def count_archives(archives, num_proc):
    """Counting the documents of OpenWebText, one archive per process: decompressing is the work."""
    counts, num_proc = Counter(), min(num_proc, len(archives))
    # in order, so that the first damaged archive is the one named
    with workers.ordered_map(count_archive, archives, num_proc,
                             ahead=-(-len(archives) // num_proc)) as results, \
            tqdm(total=len(archives), desc="counting documents", unit=" archives") as bar:
        for n in results:
            counts.update(n)
            bar.set_postfix(documents=f"{counts['documents']:,}")
            bar.update()
    total = counts["documents"] + counts["empty"]
    print(f"OpenWebText: {total:,} documents (.txt files) in {len(archives)} archives")
    if total != OWT_DOCUMENTS:
        missing = sorted({os.path.basename(a) for a in OWT_ARCHIVES} -
                         {os.path.basename(a) for a in archives})
        print(f"prepare.py: warning: OpenWebText is {OWT_DOCUMENTS:,} documents in "
              f"{len(OWT_ARCHIVES)} archives (urlsf_subset00.tar to urlsf_subset20.tar), but "
              f"the archives read here hold {total:,} (missing archives: "
              f"{', '.join(missing) or 'none'}). They are a partial download or copy, or "
              f"upstream changed them; the token files will hold only these documents, and "
              f"the expected numbers in docs/data.md do not apply.", file=sys.stderr)
    return counts

