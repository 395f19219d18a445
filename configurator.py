"""Configuration as nanoGPT takes it: `python train.py config/x.py --key=value ...`.

The defaults and the type of every key live in one dataclass per script (TrainConfig in
train.py, SampleConfig in sample.py). A config file is plain python whose top-level
assignments set keys; `--key=value` sets one key. Both apply in the order given. An unknown key
or a value of the wrong type is a UserError that names it and suggests the closest keys. A key
typed Literal[...] takes only the values listed, so its choices are checked here, once.
"""
import ast
import dataclasses
import difflib
import os
import types
import typing

from errors import UserError


def _coerce(key, value, typ, where):
    if typing.get_origin(typ) is typing.Literal:
        choices = typing.get_args(typ)
        if value not in choices:
            raise UserError(f"{where}: {key}={value!r} is not one of "
                            f"{', '.join(map(repr, choices))}")
        return value
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is int and isinstance(value, bool) or not isinstance(value, typ):
        raise UserError(
            f"{where}: {key} must be {typ.__name__}, got {value!r} ({type(value).__name__}); "
            f"for example --{key}={_example(typ)}")
    return value


def _example(typ):
    return {bool: "True", int: "8", float: "3e-4", str: "text"}[typ]


def _check_key(key, types_, where):
    if key not in types_:
        close = difflib.get_close_matches(key, types_, n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise UserError(f"{where}: unknown key {key!r}; {hint}"
                          f"the keys are listed in the README under Configuration.")


def _read_config_file(path):
    if not os.path.isfile(path):
        raise UserError(f"config file {path} does not exist (config files are paths such "
                          f"as config/quickstart.py; settings are given as --key=value)")
    with open(path) as f:
        source = f.read()
    scope = {}
    try:
        exec(compile(source, path, "exec"), scope)
    except SyntaxError as e:
        raise UserError(f"config file {path} does not parse: line {e.lineno}: {e.msg}") from e
    except Exception as e:
        raise UserError(f"config file {path} failed while running: "
                          f"{type(e).__name__}: {e}") from e
    return {k: v for k, v in scope.items() if not k.startswith("_")
            and not isinstance(v, (types.ModuleType, types.FunctionType, type))}


def _parse_value(raw, typ):
    if typing.get_origin(typ) is typing.Literal:  # the type of its choices
        typ = type(typing.get_args(typ)[0])
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = None
    if typ is str and not isinstance(value, str):  # --out_dir=out-2 and --start=42 are text
        return raw
    if value is None:
        raise UserError(f"cannot read the value {raw!r}")
    return value


def parse(config_cls, argv):
    """An instance of config_cls from its defaults, config files and --key=value arguments."""
    return parse_given(config_cls, argv)[0]


def parse_given(config_cls, argv):
    """(the configuration, the keys that config files and arguments set): a run that takes its
    architecture from weights must tell a key the user chose from a default."""
    types_ = typing.get_type_hints(config_cls)
    values = {}
    for arg in argv:
        if arg.startswith("--"):
            key, sep, raw = arg[2:].partition("=")
            where = f"argument {arg}"
            if not sep:
                raise UserError(f"{where}: settings are written --key=value")
            _check_key(key, types_, where)
            try:
                value = _parse_value(raw, types_[key])
            except UserError as e:
                raise UserError(f"{where}: {e}") from None
            values[key] = _coerce(key, value, types_[key], where)
        else:
            for key, value in _read_config_file(arg).items():
                _check_key(key, types_, f"config file {arg}")
                values[key] = _coerce(key, value, types_[key], f"config file {arg}")
    return config_cls(**values), frozenset(values)


def describe(cfg):
    """The effective configuration, one key per line, for the log."""
    return "\n".join(f"  {f.name} = {getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg))
