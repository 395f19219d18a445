"""The README's quick start, as a newcomer runs it, shortened to a few steps."""
import os
import re
import sysconfig
import tokenize

import pytest

from conftest import python, torchrun


@pytest.mark.slow
def test_quick_start_prepares_trains_and_samples(env, tmp_path):
    data_dir, out_dir = tmp_path / "data" / "pystdlib", tmp_path / "out-quickstart"
    p = python("prepare.py", "--dataset=pystdlib", "--tokenizer=byte", "--val_fraction=0.02",
               f"--out_dir={data_dir}", env=env)
    check_undecodable_named(p.stdout)
    p = torchrun(2, "train.py", "config/quickstart.py", f"--data_dir={data_dir}",
                 f"--out_dir={out_dir}", "--max_iters=10", "--eval_interval=10",
                 "--eval_iters=2", "--log_interval=5", env=env)
    assert "world size 2" in p.stdout and "iter 10: train loss" in p.stdout
    assert os.path.exists(out_dir / "ckpt_0000010.pt")
    p = python("sample.py", f"--out_dir={out_dir}", "--start=def ", "--num_samples=2",
               "--max_new_tokens=50", env=env)
    samples = p.stdout.split("---------------\n")
    assert len(samples) == 3 and samples[-1] == ""
    assert all(s.startswith("def ") and len(s) > 40 for s in samples[:2])


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
