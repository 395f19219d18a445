"""prepare.py run as a user runs it, on small corpora in tmp_path: the token files must decode back
to the documents, meta.json must describe them, and bad input must fail with one clear line."""
import glob
import json
import os
import subprocess
import sysconfig
import tokenize
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ddpgpt import permutation, tokenfile
from conftest import OUTPUTS, ROOT, decoded, fails, prepare_fails, python
from ddpgpt.tokenizer import get_tokenizer

DOCS = ["Hello, world!\n", "ünïcödé — 日本語 🎉\r\nsecond line", "", "   \n\t",
        "a document that says <|endoftext|> in the middle", "x"] + \
       [f"document {i}: " + "lorem ipsum " * i for i in range(20)]
NON_EMPTY = [d for d in DOCS if d.strip()]


def write_jsonl(path, docs, column="text"):
    path.write_text("".join(json.dumps({column: d, "id": i}) + "\n" for i, d in enumerate(docs)))


def write_parquet(path, docs, column="text"):
    pq.write_table(pa.table({column: docs, "id": list(range(len(docs)))}), path)


@pytest.mark.parametrize("tokenizer", ["gpt2", "byte"])
def test_round_trip(tokenizer, env, tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", env["TIKTOKEN_CACHE_DIR"])
    tok = get_tokenizer(tokenizer)
    write_jsonl(tmp_path / "docs.jsonl", DOCS)
    p = python("prepare.py", "--dataset", tmp_path / "docs.jsonl", "--tokenizer", tokenizer,
               "--out_dir", tmp_path / "out", "--val_docs=4", "--seed=7", "--num_proc=2",
               env=env)
    assert "tokens/s" in p.stdout
    docs = decoded(tmp_path / "out", tok)
    assert Counter(docs["train"] + docs["val"]) == Counter(NON_EMPTY)
    # the documented rule: non-empty document d is in val iff permute(d, n, key(seed)) < n_val
    in_val = permutation.permute(np.arange(len(NON_EMPTY)), len(NON_EMPTY),
                                 permutation.hash_key(7)) < 4
    assert docs["val"] == [d for d, v in zip(NON_EMPTY, in_val) if v]
    assert docs["train"] == [d for d, v in zip(NON_EMPTY, in_val) if not v]
    meta = json.loads((tmp_path / "out" / tokenfile.META_NAME).read_text())
    assert meta["skipped_empty_documents"] == 2 and meta["seed"] == 7


@pytest.mark.parametrize("tokenizer", ["gpt2", "byte"])
def test_lone_surrogates_in_json_become_replacement_characters(tokenizer, env, tmp_path,
                                                                monkeypatch):
    """JSON can escape a lone surrogate ("\\ud800"), which UTF-8 cannot encode: every tokenizer
    encodes it as U+FFFD, tiktoken by itself and the byte tokenizer as tiktoken does."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", env["TIKTOKEN_CACHE_DIR"])
    odd = {"lone \ud800 high": "lone \ufffd high", "\udfff": "\ufffd",
           "a pair, escaped: \ud83c\udf89": "a pair, escaped: \U0001f389"}
    write_jsonl(tmp_path / "docs.jsonl", [*odd, *NON_EMPTY])  # json.dumps writes \ud800
    assert "\\ud800" in (tmp_path / "docs.jsonl").read_text()
    python("prepare.py", "--dataset", tmp_path / "docs.jsonl", f"--tokenizer={tokenizer}",
           "--out_dir", tmp_path / "out", "--val_docs=2", "--num_proc=2", env=env)
    docs = decoded(tmp_path / "out", get_tokenizer(tokenizer))
    assert Counter(docs["train"] + docs["val"]) == Counter([*odd.values(), *NON_EMPTY])


def txt_glob(d):
    for i, doc in enumerate(DOCS):
        (d / f"{i:02d}.txt").write_text(doc, newline="")
    (d / "notes.md").write_text("not part of the corpus")
    return [f"{d}/*.txt"], "corpus"


def jsonl(d):
    write_jsonl(d / "web.jsonl", DOCS)
    return [d / "web.jsonl"], "web"


def json_list(d):
    (d / "books.json").write_text(json.dumps([{"body": doc} for doc in DOCS]))
    return [d / "books.json", "--text_column=body"], "books"


def parquet(d):
    write_parquet(d / "shard.parquet", DOCS, column="content")
    return [d / "shard.parquet", "--text_column=content"], "shard"


def folder(d):
    (d / "a" / "b").mkdir(parents=True)
    (d / "a" / "0.txt").write_text(DOCS[0])
    write_jsonl(d / "a" / "b" / "1.jsonl", DOCS[1:8])
    write_parquet(d / "a" / "2.parquet", DOCS[8:16])
    (d / "a" / "b" / "3.json").write_text("".join(json.dumps({"text": t}) + "\n"
                                                  for t in DOCS[16:]))  # JSON lines
    return [d / "a"], "a"


@pytest.mark.parametrize("source", [txt_glob, jsonl, json_list, parquet, folder])
def test_source_kinds(source, env, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    args, name = source(corpus)
    # no --out_dir: the default is data/<name> under the working directory
    python("prepare.py", "--dataset", *args, "--tokenizer=byte", "--val_docs=3", "--num_proc=2",
           env=env, cwd=tmp_path)
    docs = decoded(tmp_path / "data" / name, get_tokenizer("byte"))
    assert Counter(docs["train"] + docs["val"]) == Counter(NON_EMPTY) and len(docs["val"]) == 3


def test_pystdlib(env, tmp_path):
    """The README quick start's command: this Python's own standard library, no network."""
    python("prepare.py", "--dataset=pystdlib", "--tokenizer=byte", "--val_fraction=0.02",
           "--num_proc=2", env=env, cwd=tmp_path)
    out = tmp_path / "data" / "pystdlib"
    meta = json.loads((out / tokenfile.META_NAME).read_text())
    root = sysconfig.get_paths()["stdlib"]
    files = [p for p in glob.glob(f"{root}/**/*.py", recursive=True)
             if not {"site-packages", "dist-packages"} & set(os.path.relpath(p, root).split("/"))]
    train, val = (meta["splits"][s]["documents"] for s in tokenfile.SPLITS)
    skipped = meta["skipped_empty_documents"] + meta["skipped_undecodable_files"]
    assert train + val + skipped == len(files) and val == round((train + val) * 0.02)
    assert meta["splits"]["train"]["tokens"] > 10_000_000
    for split in tokenfile.SPLITS:
        tokenfile.open_split(str(out), split, block_size=128)  # config/quickstart.py's block_size
        assert meta["splits"][split]["fingerprint"] == tokenfile.sampled_fingerprint(
            [out / f"{split}.bin"])
    # each validation document is a whole source file, as Python decodes it (coding cookies)
    sources = set()
    for path in files:
        try:
            with tokenize.open(path) as f:
                sources.add(f.read())
        except (SyntaxError, UnicodeDecodeError):
            pass
    tokens = np.fromfile(out / "val.bin", dtype=np.uint16)
    ends = np.flatnonzero(tokens == 256)
    for a, b in zip(np.concatenate([[0], ends[:-1] + 1]), ends):
        assert tokens[a:b].astype(np.uint8).tobytes().decode() in sources
    assert not glob.glob(str(out / "*.tmp"))


def test_same_seed_same_bytes(env, tmp_path):
    write_jsonl(tmp_path / "docs.jsonl", DOCS * 3)
    for out in ("one", "two"):
        python("prepare.py", "--dataset", tmp_path / "docs.jsonl", "--tokenizer=byte",
               "--out_dir", tmp_path / out, "--val_fraction=0.1", "--num_proc=2", env=env)
    for name in OUTPUTS:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    meta = json.loads((tmp_path / "one" / tokenfile.META_NAME).read_text())
    assert meta["splits"]["val"]["documents"] == round(len(NON_EMPTY) * 3 * 0.1)


def bad_input(tmp_path, env):
    """(arguments, what the message must name) for each kind of bad input."""
    write_jsonl(tmp_path / "body.jsonl", DOCS, column="body")
    write_parquet(tmp_path / "body.parquet", DOCS, column="body")
    write_jsonl(tmp_path / "blank.jsonl", ["", " \n ", "\t"])
    write_jsonl(tmp_path / "three.jsonl", ["a", "b", "c"])
    (tmp_path / "latin1.txt").write_bytes("café crème".encode("latin-1"))
    (tmp_path / "latin1.jsonl").write_bytes('{"text": "café"}\n'.encode("latin-1"))
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "book.txt").write_text("The whole of one book.\n\nIts second paragraph.\n")
    empty_cache = tmp_path / "empty_cache"
    empty_cache.mkdir()
    env["TIKTOKEN_CACHE_DIR"] = str(empty_cache)  # nothing cached, and no network
    jsonl_ = str(tmp_path / "three.jsonl")
    return {
        "no such file": (["--dataset", tmp_path / "missing.jsonl"], "missing.jsonl"),
        "no glob match": (["--dataset", f"{tmp_path}/*.parquet.gz"], "*.parquet.gz"),
        "not on the hub": (["--dataset=nobody-xyz/no-such-corpus"], "network"),
        "no text field": (["--dataset", tmp_path / "body.jsonl"], "'body'"),
        "no text column": (["--dataset", tmp_path / "body.parquet"], "body (string), id (int64)"),
        "empty corpus": (["--dataset", tmp_path / "blank.jsonl"], "no non-empty documents"),
        "val takes all": (["--dataset", jsonl_, "--val_docs=3"], "no training"),
        "no val docs": (["--dataset", jsonl_, "--val_docs=0"],
                        "--val_docs=0 leaves no val split: give --val_docs=1 or more, or leave "
                        "it out and use --val_fraction."),
        "one document": (["--dataset", tmp_path / "book.txt"], "single document"),
        "unwritable out_dir": (["--dataset", jsonl_, "--out_dir", tmp_path / "a_file" / "out"],
                               "a_file"),
        "not utf-8 txt": (["--dataset", tmp_path / "latin1.txt"], "latin1.txt"),
        "not utf-8 jsonl": (["--dataset", tmp_path / "latin1.jsonl"], "latin1.jsonl"),
        "unknown tokenizer": (["--dataset", jsonl_, "--tokenizer=nope"], "'nope'"),
        "vocab offline": (["--dataset", jsonl_, "--tokenizer=cl100k_base"], "TIKTOKEN_CACHE_DIR"),
    }


@pytest.mark.parametrize("case", ["no such file", "no glob match", "not on the hub",
                                  "no text field", "no text column", "empty corpus",
                                  "val takes all", "no val docs", "one document",
                                  "unwritable out_dir", "not utf-8 txt", "not utf-8 jsonl",
                                  "unknown tokenizer", "vocab offline"])
def test_bad_input(case, env, tmp_path):
    args, named = bad_input(tmp_path, env)[case]
    tokenizer = [] if any(str(a).startswith("--tokenizer") for a in args) else ["--tokenizer=byte"]
    message = prepare_fails(tmp_path, *args, *tokenizer, "--num_proc=1", env=env)
    assert named in message, message


def test_offline_tiktoken_error_gives_commands_that_work(env, tmp_path):
    """With tiktoken's vocabulary neither cached nor downloadable, the error gives the commands
    that install the copy this checkout ships; run as given, they make the same prepare work
    (was: advice naming a function and a --tokenizer key that sample.py does not have)."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"{i}.txt").write_text(f"document number {i}\n")
    args = [f"--dataset={docs}", "--tokenizer=gpt2", "--val_docs=1", "--out_dir=out"]
    offline = dict(env, TIKTOKEN_CACHE_DIR=str(tmp_path / "empty"))
    message = fails("prepare.py", *args, env=offline, cwd=tmp_path).stderr.strip()
    commands = message.split("point tiktoken at it: ")[1].split(" (this checkout ships")[0]
    subprocess.run(["bash", "-c", f"{commands} && python {ROOT}/prepare.py {' '.join(args)}"],
                   cwd=tmp_path, env=offline, check=True, capture_output=True)
    assert (tmp_path / "out" / "train.bin").stat().st_size > 0
