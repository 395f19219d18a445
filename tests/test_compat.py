"""What earlier versions wrote still works: a checkpoint that train.py of main at d4937ea (the
last commit before ddpgpt/ became a package) wrote at iter 4, with its data, resumes and repeats
that version's iters 4 to 8 (the same batches bit for bit, the same losses), and sample.py,
eval.py and export.py read it.

The losses were recorded on the AMD EPYC that made the fixture. Another CPU's kernels (an Intel
Xeon's AVX-512 and AMX) round float32 differently: iter 4's loss differs in the 7th digit there.
So the losses are compared within float32 rounding (LOSS_RTOL), which a broken resume misses
by far (without the optimizer's state, iter 5's loss is 1.5e-3 off, 150 times LOSS_RTOL);
each batch's fingerprint, integers alone, is compared exactly."""
import json
import os
import shutil

import pytest

from conftest import ROOT, evals, python, steps

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "main-d4937ea")
LOSS_RTOL = 1e-5  # float32 rounding over 4 steps of a 1-layer model, on any CPU


@pytest.fixture
def old_run(tmp_path):
    """(its out_dir, holding only ckpt_0000004.pt; its data folder; what that version logged)"""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(os.path.join(FIXTURE, "ckpt_0000004.pt"), out)
    shutil.copytree(os.path.join(FIXTURE, "data"), tmp_path / "data")
    with open(os.path.join(FIXTURE, "expected.json")) as f:
        return out, tmp_path / "data", json.load(f)


def test_a_checkpoint_of_main_d4937ea_resumes_its_run(old_run, env):
    out, data_dir, expected = old_run
    python("train.py", f"--data_dir={data_dir}", f"--out_dir={out}", "--init_from=resume",
           *expected["args"], env=env)
    rows = steps(out)
    assert [rows[i]["batch_fp"] for i in range(4, 8)] == \
        [expected["steps"][str(i)]["batch_fp"] for i in range(4, 8)]
    for i in range(4, 8):
        assert rows[i]["loss"] == pytest.approx(expected["steps"][str(i)]["loss"], rel=LOSS_RTOL), i
    last = evals(out)[-1]
    assert last["iter"] == 8
    for key, value in expected["eval_8"].items():
        assert last[key] == pytest.approx(value, rel=LOSS_RTOL), key


@pytest.mark.slow
def test_sample_eval_and_export_read_it(old_run, env, tmp_path):
    out, data_dir, expected = old_run
    p = python("sample.py", f"--out_dir={out}", "--start=def ", "--num_samples=1",
               "--max_new_tokens=20", env=env)
    assert p.stdout.startswith("def ") and "ckpt_0000004.pt (iter 4), tokenizer 'byte'" in p.stderr
    p = python("eval.py", f"--out_dir={out}", f"--data_dir={data_dir}", "--hellaswag=False",
               "--eval_iters=2", "--batch_size=4", env=env)
    result = json.loads(p.stdout.splitlines()[-1])
    assert result["val_loss"] == pytest.approx(expected["eval_4"]["val_loss"], rel=LOSS_RTOL)
    python("export.py", f"--out_dir={out}", f"--to={tmp_path / 'exported'}", env=env)
    assert (tmp_path / "exported" / "model.safetensors").is_file()
