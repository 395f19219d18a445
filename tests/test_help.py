"""Every script answers --help (and -h) as a newcomer types it: its keys, each with its type,
range, default and one line of help, in the order of the settings class that parses them, so
there is no second list to keep in step; export.py and compare_runs.py, which take positional
arguments, answer argparse's usage. A mistyped key points at --help."""
import dataclasses
import os
import sys
import textwrap
import typing

import pytest

from ddpgpt import configurator, settings
from conftest import ROOT, fails, python, run

SCRIPTS = {"train.py": settings.TrainConfig, "sample.py": settings.SampleConfig,
           "eval.py": settings.EvalConfig, "prepare.py": settings.PrepareConfig,
           "index_documents.py": settings.IndexConfig}


def expected_entries(config_cls):
    """What --help must say of each key: `--key=default  (type[, range])` and its help."""
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        kind = configurator.type_name(hints[f.name])
        if configurator.bounds_text(f.metadata):
            kind += f", {configurator.bounds_text(f.metadata)}"
        assert f.metadata["help"], f"{config_cls.__name__}.{f.name} has no help"
        yield f"  --{f.name}={default!r}  ({kind})", " ".join(f.metadata["help"].split())


@pytest.fixture(scope="module")
def train_help(session_env):
    """What `python train.py --help` prints: asked once, read by the test of train.py's keys
    and by the one of -h."""
    return python("train.py", "--help", env=session_env).stdout


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_help_lists_every_key_with_its_type_default_and_help(script, env, request):
    out = request.getfixturevalue("train_help") if script == "train.py" else \
        python(script, "--help", env=env).stdout
    assert out.startswith(f"usage: python {script} [config files] [--key=value ...]\n")
    assert textwrap.dedent(SCRIPTS[script].__doc__).strip().splitlines()[0] in out
    where = 0
    for line, help_words in expected_entries(SCRIPTS[script]):
        found = out.find(line + "\n", where)
        assert found >= where, f"{line!r} missing, or out of order, in\n{out}"
        where = found + len(line) + 1
        # the help follows on the next lines, wrapped and indented
        following = out[where:].split("\n  --")[0]
        assert " ".join(following.split()) == help_words, following


@pytest.mark.slow
def test_h_is_help_too_wherever_it_is(env, train_help):
    out = train_help
    assert python("train.py", "config/quickstart.py", "--max_iters=5", "-h", env=env).stdout == out


@pytest.mark.slow
def test_the_lightning_example_answers_help(env):
    out = python("examples/lightning_datamodule.py", "--help", env=env).stdout
    assert out.startswith("usage: python examples/lightning_datamodule.py [config files]")
    for line in ("  --devices=1  (int, at least 1)\n", "  --max_steps=100  (int, at least 1)\n",
                 "  --sampling='epoch'  (epoch|random|documents)\n"):
        assert line in out, out


@pytest.mark.parametrize("script, words", [
    ("export.py", ["usage: export.py [-h] OUT_DIR DEST", "a run's out_dir (its newest "
                   "checkpoint), or a checkpoint file or", "the folder to write, or a file "
                   "ending in .pt; it must not exist",
                   # what follows the description's colon (was: nothing)
                   "  python export.py out/ckpt_0000040.pt gpt2-finetuned"]),
    ("compare_runs.py", ["usage: compare_runs.py [-h] [--losses] run_a run_b",
                         "a run's out_dir (its metrics.jsonl)", "also compare losses exactly"]),
    ("plot.py", ["usage: plot.py [-h]", "a run's out_dir (its metrics.jsonl); several for one "
                 "figure"]),
])
def test_scripts_with_positional_arguments_answer_argparses_help(script, words, env):
    out = python(script, "--help", env=env).stdout
    assert all(w in out for w in words), out


@pytest.mark.parametrize("script, typo, key", [
    ("sample.py", "--max_new_token=20", "max_new_tokens"),
    ("eval.py", "--hellaswg=False", "hellaswag"),
    ("prepare.py", "--tokeniser=byte", "tokenizer"),
])
def test_a_mistyped_key_points_at_the_right_one_and_at_help(script, typo, key, env):
    message = fails(script, typo, env=env).stderr.strip().splitlines()[-1]
    assert f"did you mean {key}" in message and f"`python {script} --help` lists the keys" \
        in message, message


@pytest.mark.parametrize("script", ["train.py", "sample.py", "eval.py", "plan.py",
                                    "examples/lightning_datamodule.py"])
def test_a_mistyped_key_is_answered_before_torch_is_imported(script, env):
    """The scripts that import torch read their settings first: a typo is answered in a
    moment, not after torch's import (seconds; Lightning's, ten). `-X importtime` lists each
    module imported."""
    p = run([sys.executable, "-X", "importtime", os.path.join(ROOT, script), "--no_such_key=1"],
            env, check=False)
    assert p.returncode == 1 and f"{script}: error: argument --no_such_key=1: unknown key " \
        f"'no_such_key'" in p.stderr, p.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines()
                if line.startswith("import time:")]
    assert "ddpgpt.configurator" in imported and "torch" not in imported, imported
