"""A corpus folder as a real one is: besides its documents it holds version control, macOS's
and editors' leftovers, a README, compressed files, symlinks (loops too), empty files, a
previous prepare's output. prepare.py reads the documents, each file once, skips the rest with
a line per kind, and refuses what cannot be meant."""
import bz2
import gzip
import json
import lzma
import os

import pyarrow as pa
import pytest

from conftest import decoded, fails, python
from ddpgpt.tokenizer import get_tokenizer

BYTE = ["--tokenizer=byte", "--val_docs=2", "--num_proc=1"]


def jsonl(docs):
    return "".join(json.dumps({"text": d}) + "\n" for d in docs)


def messy_corpus(root):
    """A corpus folder with everything a real one can hold; returns its documents."""
    os.makedirs(root)
    docs = {"a.jsonl": [f"plain document {i}" for i in range(4)], "B.TXT": ["upper-case name"],
            "c.jsonl.gz": ["gzip 1", "gzip 2"], "d.txt.xz": ["xz text"],
            "e.json.bz2": ["bz2 list"], "sub/f.JSONL.zst": ["zstd"]}
    write = {".gz": gzip.open, ".xz": lzma.open, ".bz2": bz2.open}
    for name, texts in docs.items():
        path = os.path.join(root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        text = texts[0] if name.lower().endswith((".txt", ".txt.xz")) else \
            json.dumps([{"text": t} for t in texts]) if ".json." in name else jsonl(texts)
        ext = os.path.splitext(name)[1]
        if ext == ".zst":
            with pa.output_stream(path, compression="zstd") as f:
                f.write(text.encode())
        else:
            with write.get(ext, open)(path, "wt") as f:
                f.write(text)
    extras = {".git/config": "[core]", ".git/objects/ab": "x", ".DS_Store": "\0\1",
              ".a.jsonl.swp": "\0", "__MACOSX/._a.jsonl": "\0\5", "a.jsonl~": "backup",
              "#a.jsonl#": "autosave", "README.md": "# my corpus", "notes.csv": "a,b",
              "archive.tar.gz": "\0", "empty.txt": "", "empty.parquet": ""}
    for name, text in extras.items():
        os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
        with open(os.path.join(root, name), "w") as f:
            f.write(text)
    os.symlink("a.jsonl", os.path.join(root, "again.jsonl"))  # the same file twice
    os.symlink("..", os.path.join(root, "sub", "up"))  # a loop
    os.symlink("nowhere.txt", os.path.join(root, "broken.txt"))
    os.symlink("self", os.path.join(root, "self"))  # a symlink loop of one link
    os.mkfifo(os.path.join(root, "pipe.jsonl"))  # reading it would wait forever
    return [t for texts in docs.values() for t in texts]


def notices(stdout):
    """{kind's words: the count and names} of the 'skipped' lines."""
    lines = [line.removeprefix("prepare.py: skipped ") for line in stdout.splitlines()
             if line.startswith("prepare.py: skipped ")]
    return dict(line.rsplit(": ", 1) for line in lines)


def test_a_real_folder_is_read_as_its_documents_each_once(env, tmp_path):
    corpus = tmp_path / "corpus"
    expected = messy_corpus(str(corpus))
    out = corpus / "data"  # the out_dir inside the corpus folder
    p = python("prepare.py", f"--dataset={corpus}", *BYTE, f"--out_dir={out}", env=env)
    docs = decoded(out, get_tokenizer("byte"))
    assert sorted(docs["train"] + docs["val"]) == sorted(expected)
    said = notices(p.stdout)
    c = f"{corpus}/"
    assert said == {
        "hidden files and folders (names that start with '.': .git, .DS_Store, editor swap "
        "files .*.swp, ...)": f"3 ({c}.DS_Store, {c}.a.jsonl.swp, {c}.git)",
        "__MACOSX folders (macOS's archive metadata, not documents)": f"1 ({c}__MACOSX)",
        "editor backup files (*~, #*#)": f"2 ({c}#a.jsonl#, {c}a.jsonl~)",
        "broken symlinks and symlink loops": f"2 ({c}broken.txt, {c}self)",
        "files or folders reached again through a symlink (each is read once)":
            f"2 ({c}again.jsonl, {c}sub/up)",
        "things that are not regular files (FIFOs, sockets, devices)": f"1 ({c}pipe.jsonl)",
        "files of other kinds (prepare.py reads .txt, .jsonl, .json, .parquet, the first three "
        "also compressed .gz, .bz2, .xz, .zst; to read files of another kind as text, name "
        "them with a glob: --dataset='<folder>/**/*.md')": f"3 ({c}README.md, "
                                                           f"{c}archive.tar.gz, {c}notes.csv)",
        "empty files (0 bytes)": f"2 ({c}empty.parquet, {c}empty.txt)"}, p.stdout
    # run again: its own output, now in the corpus folder, is skipped, not read
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    p = python("prepare.py", f"--dataset={corpus}", *BYTE, f"--out_dir={out}", env=env)
    assert notices(p.stdout)["folders of token files that prepare.py wrote (its meta.json, "
                             "progress file or lock are not documents)"] == f"1 ({out})"
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before


def test_a_glob_reads_each_file_once_and_skips_the_output_of_prepare(env, tmp_path):
    corpus = tmp_path / "corpus"
    expected = messy_corpus(str(corpus))
    python("prepare.py", f"--dataset={corpus}", *BYTE, f"--out_dir={corpus / 'data'}", env=env)
    out = tmp_path / "out"
    p = python("prepare.py", f"--dataset={corpus}/**/*.json*", *BYTE, f"--out_dir={out}", env=env)
    assert f"{corpus}/data/meta.json" in p.stdout
    assert "reached again through a symlink" in p.stdout  # again.jsonl, and sub/up's loop
    docs = decoded(out, get_tokenizer("byte"))  # a glob is case-sensitive: not f.JSONL.zst
    assert sorted(docs["train"] + docs["val"]) == \
        sorted(expected[:4] + ["gzip 1", "gzip 2", "bz2 list"])


def test_a_glob_of_another_extension_reads_those_files_as_text(env, tmp_path):
    """A folder of .md (or .py) files was refused, with no word of how to read them."""
    notes = tmp_path / "notes"
    (notes / "sub").mkdir(parents=True)
    texts = {"a.md": "# one\n\nfirst note\n", "sub/b.md": "second note\n",
             "sub/c.mdx": "not named\n"}
    for name, text in texts.items():
        (notes / name).write_text(text)
    args = ["--tokenizer=byte", "--num_proc=1", "--val_docs=1"]
    p = fails("prepare.py", f"--dataset={notes}", *args, env=env)
    assert "to read files of another kind as text, name them with a glob: " \
           "--dataset='<folder>/**/*.md'." in p.stderr, p.stderr
    out = tmp_path / "out"
    python("prepare.py", f"--dataset={notes}/**/*.md", *args, f"--out_dir={out}", env=env)
    docs = decoded(out, get_tokenizer("byte"))
    assert sorted(docs["train"] + docs["val"]) == [texts["a.md"], texts["sub/b.md"]]


def damaged(tmp_path, name):
    """A corpus whose compressed file `name` is cut off in the middle."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "ok.jsonl").write_text(jsonl(["one", "two", "three"]))
    opener = {".gz": gzip.open, ".xz": lzma.open, ".bz2": bz2.open}[os.path.splitext(name)[1]]
    with opener(corpus / name, "wt") as f:
        f.write(jsonl([f"document {i} " + "text " * 50 for i in range(2000)]))
    data = (corpus / name).read_bytes()
    (corpus / name).write_bytes(data[:len(data) // 2])
    return corpus


@pytest.mark.parametrize("case", ["dataset is an output", "out_dir is the corpus",
                                  "cut-off .gz", "cut-off .xz", "cut-off .bz2"])
def test_what_cannot_be_meant_is_refused_with_a_reason(case, env, tmp_path):
    if case.startswith("cut-off"):
        corpus = damaged(tmp_path, f"big.jsonl{case[-4:].strip()}")
        args, words = [f"--dataset={corpus}"], [f"{corpus}/big.jsonl", "could not be "
                                                "decompressed", "damaged or cut off"]
    else:
        corpus = tmp_path / "corpus"
        messy_corpus(str(corpus))
        python("prepare.py", f"--dataset={corpus}", *BYTE, f"--out_dir={tmp_path / 'data'}",
               env=env)
        args, words = {
            "dataset is an output": ([f"--dataset={tmp_path / 'data'}"],
                                     ["holds token files that prepare.py wrote", "not a corpus"]),
            "out_dir is the corpus": ([f"--dataset={corpus}", f"--out_dir={corpus}"],
                                      ["is the corpus folder itself", "outside it"])}[case]
    out = [] if any(a.startswith("--out_dir") for a in args) else [f"--out_dir={tmp_path / 'o'}"]
    message = fails("prepare.py", *args, *BYTE, *out, env=env).stderr.strip().splitlines()[-1]
    assert message.startswith("prepare.py: error: ") and all(w in message for w in words), message
    assert not os.path.exists(tmp_path / "o" / "train.bin")
