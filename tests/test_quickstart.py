"""The README's quick start, as a newcomer runs it, shortened to a few steps."""
import os
import re
import sys
import sysconfig
import tokenize

import pytest

from conftest import ROOT, python, torchrun

# the numbers of a line that differ from run to run: timings; in train.py's lines, all of
# them (losses differ in their last digits between kinds of CPU)
TIMINGS = re.compile(r"[\d,.]+(?= ms| tok/s| tokens/s| s in all| s\)|%$)")
NUMBERS = re.compile(r"\d[\d,.]*(?:e[+-]?\d+)?")


@pytest.fixture(scope="module")
def quick_start(session_env, tmp_path_factory):
    """What prepare.py and train.py print, and the out_dir: the README's commands, but for 10
    steps of train.py's 1,000, evaluated on 2 batches of its 20."""
    tmp = tmp_path_factory.mktemp("quickstart")
    data_dir, out_dir = tmp / "data" / "pystdlib", tmp / "out-quickstart"
    prepared = python("prepare.py", "--dataset=pystdlib", "--tokenizer=byte",
                      "--val_fraction=0.02", f"--out_dir={data_dir}", env=session_env)
    trained = torchrun(2, "train.py", "config/quickstart.py", f"--data_dir={data_dir}",
                       f"--out_dir={out_dir}", "--max_iters=10", "--eval_interval=10",
                       "--eval_iters=2", "--log_interval=5", env=session_env)
    return prepared.stdout, trained.stdout, out_dir


@pytest.mark.slow
def test_quick_start_prepares_trains_and_samples(quick_start, env):
    prepared, trained, out_dir = quick_start
    check_undecodable_named(prepared)
    assert "world size 2" in trained and "iter 10: train loss" in trained
    assert os.path.exists(out_dir / "ckpt_0000010.pt")
    p = python("sample.py", f"--out_dir={out_dir}", "--start=def ", "--num_samples=2",
               "--max_new_tokens=50", env=env)
    samples = p.stdout.split("---------------\n")
    assert len(samples) == 3 and samples[-1] == ""
    assert all(s.startswith("def ") and len(s) > 40 for s in samples[:2])


@pytest.mark.slow
def test_the_readme_quotes_lines_the_quick_start_prints(quick_start):
    """Each line of prepare.py's and train.py's output that the README quotes is printed, in
    its format, and prepare.py's with its counts where the Python is the README's."""
    prepared, trained, _ = quick_start
    (of_prepare, of_train), python_version = readme_quotes()
    # prepare.py's counts are of the standard library of the Python the README names
    checked = [(of_train, trained, NUMBERS)] + (
        [(of_prepare, prepared, TIMINGS)] if sys.version_info[:3] == python_version else [])
    for quoted, out, varies in checked:
        printed = {normalized(line, varies) for line in out.splitlines()}
        missing = [line for line in quoted if normalized(line, varies) not in printed]
        assert not missing, f"the README quotes lines not printed: {missing}; printed:\n{out}"


def readme_quotes():
    """The output the README's quick start quotes: its two blocks indented 6 spaces
    (prepare.py's, train.py's) without their '...', and the Python whose standard library
    prepare.py's counts are of."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text[text.index("## Quick start"):text.index("## Next steps")]
    blocks = [[line.strip() for line in block.splitlines() if line.strip() != "..."]
              for block in re.findall(r"(?m)(?:^      \S.*\n)+", section)]
    assert len(blocks) == 2, blocks
    version = re.search(r"Python (\d+)\.(\d+)\.(\d+)'s standard library", section)
    return blocks, tuple(map(int, version.groups()))


def normalized(line, varies):
    """line with what differs between the README's run and the test's left out: the numbers
    that vary (as T), a checkpoint's iter (as N: the README's run is 1,000 steps, the test's
    10) and the folder that data/pystdlib/ or out-quickstart/ is in."""
    line = re.sub(r"\S*/((?:data/pystdlib|out-quickstart)/)", r"\1", line)
    return varies.sub("T", re.sub(r"ckpt_\d+", "ckpt_N", line))


def check_undecodable_named(stdout):
    """The standard library ships a few files that do not decode, on purpose: prepare.py names
    the first three (relative to the stdlib), then '...' for more."""
    found = re.search(r"skipped [\d,]+ empty documents, (\d+) undecodable files(?: \((.*)\))?;",
                      stdout)
    assert found, stdout
    count, named = int(found.group(1)), (found.group(2) or "").split(", ")
    if not count:
        return
    assert named[-1] == "..." if count > 3 else len(named) == count, named
    for name in named[:3]:
        with pytest.raises((SyntaxError, UnicodeDecodeError)):
            with tokenize.open(os.path.join(sysconfig.get_paths()["stdlib"], name)) as f:
                f.read()
