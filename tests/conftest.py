"""Shared helpers: the tests run the scripts as a user would, in subprocesses."""
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_VOCAB = os.path.join(ROOT, "..", "shared", "tokenizers", "r50k_base.tiktoken")
# the cache key tiktoken uses for the r50k_base (= gpt2) vocabulary file
TIKTOKEN_CACHE_KEY = "0ea1e91bbb3a60f729a8dc8f777fd2fc07cd8df4"


@pytest.fixture(scope="session")
def tiktoken_cache(tmp_path_factory):
    """A tiktoken cache folder holding the GPT-2 vocabulary, so 'gpt2' loads offline."""
    if not os.path.exists(SHARED_VOCAB):
        pytest.fail(f"{SHARED_VOCAB} is missing: the tests need ../shared beside the checkout")
    d = tmp_path_factory.mktemp("tiktoken_cache")
    shutil.copy(SHARED_VOCAB, d / TIKTOKEN_CACHE_KEY)
    return str(d)


@pytest.fixture
def env(tiktoken_cache):
    """The environment a user's shell would have, offline, one thread per process."""
    e = dict(os.environ, TIKTOKEN_CACHE_DIR=tiktoken_cache, OMP_NUM_THREADS="1",
             PYTHONUNBUFFERED="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
             WANDB_MODE="offline", PYTHONPATH=ROOT)  # PYTHONPATH: for helper scripts in tests/
    e.pop("RANK", None), e.pop("WORLD_SIZE", None), e.pop("LOCAL_RANK", None)
    return e


def run(args, env, cwd=ROOT, timeout=600, check=True):
    """Run a command like a user would; on an unexpected exit code show all it printed."""
    p = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{args} exited {p.returncode}\n--- stdout\n{p.stdout}\n"
                             f"--- stderr\n{p.stderr}")
    return p


def python(script, *args, env, **kw):
    return run([sys.executable, os.path.join(ROOT, script), *map(str, args)], env, **kw)


def torchrun(nproc, script, *args, env, **kw):
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={nproc}", os.path.join(ROOT, script), *map(str, args)],
               env, **kw)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory, tiktoken_cache):
    """A few standard-library modules as text files, prepared with the byte tokenizer."""
    root = tmp_path_factory.mktemp("corpus")
    docs = root / "docs"
    docs.mkdir()
    stdlib = sysconfig.get_paths()["stdlib"]
    for name in ("os", "argparse", "json/decoder", "shutil", "textwrap"):
        with open(os.path.join(stdlib, f"{name}.py"), encoding="utf-8") as f:
            (docs / f"{name.replace('/', '_')}.txt").write_text(f.read())
    env = dict(os.environ, TIKTOKEN_CACHE_DIR=tiktoken_cache)
    python("prepare.py", f"--dataset={docs}", "--tokenizer=byte", "--val_docs=1",
           f"--out_dir={root / 'data'}", "--num_proc=1", env=env)
    return str(root / "data")
