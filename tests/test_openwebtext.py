"""prepare.py on OpenWebText's own archives, in miniature and with no network: tars in the hub
repository's layout (subsets/urlsf_subsetNN.tar, each a tar of .xz files, each an
xz-compressed tar of .txt documents), read from a local folder and from a pre-seeded Hugging
Face cache. The documents must be what the hub's loading script made of the same files."""
import io
import json
import lzma
import os
import re
import sys
import tarfile
import tracemalloc

import numpy as np
import pytest

from ddpgpt import corpus, permutation, tokenfile
from conftest import OUTPUTS, ROOT, decoded, prepare_fails, python, run
from ddpgpt.errors import UserError
from ddpgpt.tokenizer import get_tokenizer

# an inner tar's members: (name, text), or (name, None) for a folder; the odd ones on purpose
ODD_MEMBERS = [
    ("openwebtext/0001-a.txt", "A plain document.\n"),
    ("openwebtext/", None),
    ("openwebtext/0002-b.txt", ""),
    ("openwebtext/0003-c.txt", "\n \n\n\t\n"),
    ("openwebtext/0004-d.txt", "one\n\n\ntwo\n\n\n\n\nthree\r\n\r\n\r\nfour\n\n"),
    ("openwebtext/0005-e.txt",
     "  ünïcödé — 日本語 🎉\n\n\n\n\u00a0ends in an ideographic space\u3000"),
    ("openwebtext/notes.md", "not a document"),
    ("openwebtext/._0006-f.txt", "macOS metadata, hidden"),
    ("openwebtext/0007-g.txt.bak", "a backup, not a document"),
    ("openwebtext/0008-h.txt", "says <|endoftext|> in the middle\n\n\n"),
]


def tar_bytes(members):
    """A tar of (name, bytes) files and (name, None) folders, in that order."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, content in members:
            info = tarfile.TarInfo(name)
            if content is None:
                info.type = tarfile.DIRTYPE
            else:
                info.size = len(content)
            tar.addfile(info, None if content is None else io.BytesIO(content))
    return buf.getvalue()


def xz_member(members):
    return lzma.compress(tar_bytes([(n, None if t is None else t.encode())
                                    for n, t in members]), preset=0)


def loading_script(members):
    """The rule under test, as the hub's loading script applied it to an inner tar's members."""
    return [re.sub("\n\n\n+", "\n\n", text).strip()
            for name, text in members if text is not None and name.endswith(".txt")
            and not os.path.basename(name).startswith((".", "__"))]


def odd_archive(i):
    """(the outer tar, its documents): two .xz of odd members, a folder, a non-.xz file."""
    first = ODD_MEMBERS + [(f"openwebtext/{i:02d}-x.txt", f"archive {i}, first .xz")]
    second = [(f"openwebtext/{i:02d}-{j}.txt", f"archive {i}, document {j}\n\n\n\nend")
              for j in range(3)]
    outer = tar_bytes([("openwebtext/", None),
                       (f"openwebtext/urlsf_subset{i:02d}-1_data.xz", xz_member(first)),
                       ("openwebtext/README", b"not an .xz"),
                       (f"openwebtext/urlsf_subset{i:02d}-2_data.xz", xz_member(second))])
    return outer, loading_script(first) + loading_script(second)


def write_archives(folder, archives):
    """folder/urlsf_subsetNN.tar for each archive's bytes; their documents in corpus order."""
    os.makedirs(folder, exist_ok=True)
    documents = []
    for i, (outer, docs) in enumerate(archives):
        with open(os.path.join(folder, f"urlsf_subset{i:02d}.tar"), "wb") as f:
            f.write(outer)
        documents += docs
    return documents


def check_documents(out_dir, documents, n_val, seed, tokenizer="byte"):
    """The token files hold the non-empty documents in corpus order, split by the documented
    rule, and meta.json counts the empty ones."""
    docs = decoded(out_dir, get_tokenizer(tokenizer))
    non_empty = [d for d in documents if d]
    in_val = permutation.permute(np.arange(len(non_empty)), len(non_empty),
                                 permutation.hash_key(seed)) < n_val
    assert docs["val"] == [d for d, v in zip(non_empty, in_val) if v]
    assert docs["train"] == [d for d, v in zip(non_empty, in_val) if not v]
    meta = json.loads((out_dir / tokenfile.META_NAME).read_text())
    assert meta["skipped_empty_documents"] == len(documents) - len(non_empty)


def test_documents_are_what_the_loading_script_made(env, tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", env["TIKTOKEN_CACHE_DIR"])
    documents = write_archives(tmp_path / "owt" / "subsets", [odd_archive(i) for i in range(3)])
    assert "" in documents and "one\n\ntwo\n\nthree\r\n\r\n\r\nfour" in documents
    outputs = []
    for num_proc in (2, 1):  # the same bytes, whatever the number of processes
        out = tmp_path / f"out{num_proc}"
        p = python("prepare.py", "--dataset", tmp_path / "owt", "--tokenizer=gpt2", "--val_docs=3",
                   "--seed=11", f"--num_proc={num_proc}", "--out_dir", out, env=env)
        assert f"OpenWebText: {len(documents)} documents (.txt files) in 3 archives" in p.stdout
        assert "8,013,769" in p.stderr and "urlsf_subset03.tar, " in p.stderr  # the warning
        outputs.append([(out / name).read_bytes() for name in OUTPUTS])
    check_documents(tmp_path / "out1", documents, n_val=3, seed=11, tokenizer="gpt2")
    assert outputs[0] == outputs[1]


def test_a_copy_of_the_subsets_folder_and_the_default_out_dir(env, tmp_path):
    """--dataset may name the subsets folder itself; the output goes to data/<its name>."""
    documents = write_archives(tmp_path / "subsets", [odd_archive(i) for i in range(2)])
    python("prepare.py", "--dataset=subsets", "--tokenizer=byte", "--val_docs=2",
           "--num_proc=2", env=env, cwd=tmp_path)
    check_documents(tmp_path / "data" / "subsets", documents, n_val=2, seed=2357)


def seed_hub_cache(cache, archives):
    """A Hugging Face cache holding the dataset repository's 21 archives, in the layout the
    hub library documents: refs/main names a snapshot folder that holds the files."""
    repo = cache / "datasets--Skylion007--openwebtext"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return write_archives(repo / "snapshots" / commit / "subsets", archives)


def test_the_default_dataset_reads_the_hub_cache(env, tmp_path):
    """python prepare.py with no --dataset: the 21 archives come from the hub's cache (seeded
    here; HF_HUB_OFFLINE=1, so nothing is fetched) into data/openwebtext."""
    documents = seed_hub_cache(tmp_path / "hub", [odd_archive(i) for i in range(21)])
    env.update(HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    p = python("prepare.py", "--tokenizer=byte", "--val_docs=5", "--num_proc=2", env=env,
               cwd=tmp_path)
    assert f"OpenWebText: {len(documents):,} documents (.txt files) in 21 archives" in p.stdout
    assert "missing archives: none" in p.stderr
    check_documents(tmp_path / "data" / "openwebtext", documents, n_val=5, seed=2357)


def bulk_archive(copies, words=700_000):
    """(an outer tar of `copies` copies of one .xz of random-word documents, its documents):
    big enough that holding an archive's text would show in the peak memory."""
    rng = np.random.default_rng(0)
    vocabulary = np.array(["".join(map(chr, rng.integers(97, 123, rng.integers(2, 10))))
                           for _ in range(3000)])
    text = " ".join(vocabulary[rng.integers(0, len(vocabulary), words)])
    members = [(f"{j:04d}.txt", text[a:a + 20_000]) for j, a in
               enumerate(range(0, len(text), 20_000))]
    xz = xz_member(members)
    outer = tar_bytes([(f"urlsf_subset-{c}_data.xz", xz) for c in range(copies)])
    return outer, loading_script(members) * copies


@pytest.mark.slow
def test_reading_an_archive_holds_one_document_at_a_time(tmp_path):
    """What pass 1 runs in its workers, one archive each (count_archive), and what pass 2 reads
    (archive_documents): their peak of Python's allocations, exact on every run (tracemalloc
    sees lzma's and tarfile's buffers too), must not grow with the archive."""
    peaks = {}
    for copies in (1, 6):  # about 4 MiB of text, and 26 MiB
        path = tmp_path / f"x{copies}.tar"
        outer, documents = bulk_archive(copies)
        path.write_bytes(outer)
        for name, read in (("count", corpus.count_archive),
                           ("read", lambda p: max(map(len, corpus.archive_documents(p))))):
            tracemalloc.start()
            read(str(path))
            peaks[name, copies] = tracemalloc.get_traced_memory()[1] / 2**20
            tracemalloc.stop()
        assert corpus.count_archive(str(path))["documents"] == len(documents)
    assert all(peaks[name, 6] - peaks[name, 1] < 1 for name in ("count", "read")), peaks


def peak_rss_mib(command, env):
    """The largest peak resident memory of the command's processes (prepare.py's main process,
    which reads pass 2), measured by the kernel: getrusage of the waited-for children of a
    fresh interpreter, so no peak falls between samples and no other test's processes count."""
    measure = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    p = run([sys.executable, "-c", measure, *map(str, command)], env)
    return int(p.stdout.split()[-1]) / 1024  # KiB on Linux


@pytest.mark.slow
def test_prepare_memory_is_flat_in_archive_size(env, tmp_path):
    peaks, text_mib = {}, {}
    for copies in (1, 6):
        folder = tmp_path / f"x{copies}"
        text_mib[copies] = sum(map(len, write_archives(folder, [bulk_archive(copies)]))) / 2**20
        peaks[copies] = peak_rss_mib([sys.executable, os.path.join(ROOT, "prepare.py"),
                                      f"--dataset={folder}", "--tokenizer=byte", "--num_proc=2",
                                      "--out_dir", tmp_path / f"out{copies}"], env)
    # the main process holding the archive's text would add the 22 MiB more of the larger one
    assert peaks[6] - peaks[1] < 10, (peaks, text_mib)


def headers_and_end(outer):
    """The offsets of a tar's member headers, and of its end-of-archive block."""
    with tarfile.open(fileobj=io.BytesIO(outer)) as tar:
        members = tar.getmembers()
    last = members[-1]
    return [m.offset for m in members], last.offset_data + -(-last.size // 512) * 512


def flip(content, n):
    return content[:n] + bytes([content[n] ^ 1]) + content[n + 1:]


def test_a_cut_or_damaged_archive_is_an_error(tmp_path):
    """tarfile alone reads a stream cut at or in a header, or with a damaged header, as a
    shorter archive; the reader must refuse each one rather than lose documents quietly, and
    also an .xz cut anywhere, even in its index after the last document."""
    outer, documents = odd_archive(0)
    path = tmp_path / "urlsf_subset00.tar"
    path.write_bytes(outer)
    assert list(corpus.archive_documents(str(path))) == documents
    headers, end = headers_and_end(outer)
    damaged = [outer[:n] for n in range(0, end + 512, 64)]
    damaged += [flip(outer, n + 3) for n in headers]  # in the member's name
    xz = xz_member(ODD_MEMBERS * 4)
    damaged += [tar_bytes([("a.xz", xz[:n])]) for n in range(0, len(xz), 37)] + \
        [tar_bytes([("a.xz", xz[:-1])])]
    for content in damaged:
        path.write_bytes(content)
        with pytest.raises(UserError, match="is damaged"):
            list(corpus.archive_documents(str(path)))
    path.write_bytes(outer[:end + 1024])  # cut after the end-of-archive blocks: nothing lost
    assert list(corpus.archive_documents(str(path))) == documents


def bad_input(tmp_path, env):
    """(arguments, what the message must name) for each kind of bad OpenWebText input."""
    for name in ("corrupt", "cut_xz", "not_utf8", "none"):
        (tmp_path / name / "subsets").mkdir(parents=True)
    outer, _ = odd_archive(0)
    headers, _ = headers_and_end(outer)
    (tmp_path / "corrupt" / "subsets" / "urlsf_subset00.tar").write_bytes(
        flip(outer, headers[2] + 3))  # tarfile alone would end the archive there, quietly
    xz = xz_member(ODD_MEMBERS)
    (tmp_path / "cut_xz" / "subsets" / "urlsf_subset00.tar").write_bytes(
        tar_bytes([("openwebtext/urlsf_subset00-1_data.xz", xz[:len(xz) // 2])]))
    (tmp_path / "not_utf8" / "subsets" / "urlsf_subset00.tar").write_bytes(tar_bytes([(
        "a.xz", lzma.compress(tar_bytes([("café.txt", "café".encode("latin-1"))])))]))
    (tmp_path / "none" / "README.md").write_text("an interrupted download: no subsets/*.tar")
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(tmp_path / "hf" / "hub"),
               HF_HUB_OFFLINE="1")
    return {
        "corrupt archive": (["--dataset=corrupt"], "urlsf_subset00.tar is damaged"),
        "cut-off .xz": (["--dataset=cut_xz"], "urlsf_subset00-1_data.xz, is damaged (EOFError"),
        "not UTF-8": (["--dataset=not_utf8"], "a.xz: café.txt is not UTF-8"),
        "no archives": (["--dataset=none"], "subsets/urlsf_subset*.tar"),
        "offline, nothing cached": ([], "--local-dir DIR`, copy DIR here and pass --dataset=DIR"),
    }


@pytest.mark.parametrize("case", ["corrupt archive", "cut-off .xz", "not UTF-8", "no archives",
                                  "offline, nothing cached"])
def test_bad_input(case, env, tmp_path):
    args, named = bad_input(tmp_path, env)[case]
    message = prepare_fails(tmp_path, *args, "--tokenizer=byte", "--num_proc=2", env=env)
    assert named in message, message
