"""Every script answers --help (and -h) as a newcomer types it: its keys, each with its type,
range, default and one line of help, in the order of the settings class that parses them, so
there is no second list to keep in step. A mistyped key points at --help, a renamed one at its
new name; the bare arguments that export.py, plot.py, compare_runs.py and bench.py took before
they took --key=value stand for the keys they were."""
import dataclasses
import os
import sys
import textwrap
import typing

import pytest

import bench
from ddpgpt import configurator, settings
from conftest import ROOT, fails, python, run

SCRIPTS = {"train.py": settings.TrainConfig, "sample.py": settings.SampleConfig,
           "eval.py": settings.EvalConfig, "prepare.py": settings.PrepareConfig,
           "index_documents.py": settings.IndexConfig, "export.py": settings.ExportConfig,
           "plot.py": settings.PlotConfig, "compare_runs.py": settings.CompareConfig,
           "bench.py": bench.BenchConfig}


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
    assert out.startswith(f"usage: python {script} [config files] [--key=value ...]")
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


@pytest.mark.parametrize("script, old, new", [
    ("plot.py", "--out=ab.png", "to"),  # the PNG it writes
    ("bench.py", "--dry-run", "small"),  # the gpu part's dry run is its small mode
])
def test_a_renamed_key_names_its_new_name(script, old, new, env):
    message = fails(script, old, env=env).stderr.strip().splitlines()[-1]
    assert message == (f"{script}: error: argument {old}: unknown key '{old[2:].split('=')[0]}'; "
                       f"did you mean {new} (its new name)? `python {script} --help` lists the "
                       f"keys."), message


def test_bare_arguments_stand_for_the_keys_they_were(env, tmp_path):
    """compare_runs.py A B is --out_dir=A,B, as its usage says (so are plot.py's run folders,
    and bench.py's parts: test_bench.py); export.py OUT_DIR TO is --out_dir=OUT_DIR --to=TO,
    and a third is no key's: a config file."""
    usage = python("compare_runs.py", "--help", env=env).stdout.splitlines()[0]
    assert usage == "usage: python compare_runs.py [config files] [--key=value ...] [out_dir ...]"
    a, b = tmp_path / "a", tmp_path / "b"
    bare, keyed = (fails("compare_runs.py", *args, env=env).stderr
                   for args in ([a, b], [f"--out_dir={a},{b}"]))
    assert bare == keyed == (f"compare_runs.py: error: cannot read {a}/metrics.jsonl (No such file "
                             f"or directory): give the out_dir of a train.py run\n"), bare
    message = fails("export.py", a, b, tmp_path / "c", env=env).stderr.strip()
    assert message == (f"export.py: error: config file {tmp_path / 'c'} does not exist (config "
                       f"files are paths such as config/quickstart.py; settings are given as "
                       f"--key=value)"), message


@pytest.mark.parametrize("script, args, said", [
    ("export.py", ["--out_dir=out"], "export.py: error: give --to, the folder (or .pt file) to "
     "write, one that does not exist"),
    ("compare_runs.py", ["--out_dir=out-a"], "compare_runs.py: error: out_dir='out-a': give the "
     "two runs to compare: --out_dir=a,b"),
])
def test_what_a_script_must_be_given(script, args, said, env):
    assert fails(script, *args, env=env).stderr.strip() == said


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
