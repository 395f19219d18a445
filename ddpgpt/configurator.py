"""Settings as nanoGPT takes them: `python train.py config/x.py --key=value ...`, applied in
order (docs/training.md, "Configuration"), into the dataclasses of settings.py; `--key value`,
and `--flag` for a True bool, too.

The checks run once per value as it is read, so the message can say where it came from, and
again when the dataclass is made (each settings class calls check() in __post_init__), so a
configuration built in code is checked the same way."""
import ast
import dataclasses
import difflib
import inspect
import math
import os
import textwrap
import types
import typing

from ddpgpt import errors
from ddpgpt.errors import SettingsError, UserError


def key(default, help, *, at_least=None, above=None, below=None, at_most=None, factory=None,
        was=None):
    """A settings field: its default (or a factory for one that depends on the machine), its
    one line of help, the range a number must lie in, and the name it had before, if any."""
    bounds = {"at_least": at_least, "above": above, "below": below, "at_most": at_most}
    metadata = {"help": help, "was": was, **{k: v for k, v in bounds.items() if v is not None}}
    given = {"default_factory": factory} if factory is not None else {"default": default}
    return dataclasses.field(**given, metadata=metadata)


# ---- one value ----

def choices(typ):
    return typing.get_args(typ) if typing.get_origin(typ) is typing.Literal else None


def type_name(typ):
    listed = choices(typ)
    return "|".join(map(str, listed)) if listed else typ.__name__


def bounds_text(meta):
    words = {"at_least": "at least", "above": "above", "below": "below", "at_most": "at most"}
    return " and ".join(f"{words[k]} {meta[k]}" for k in words if k in meta)


def check_value(field, typ, value):
    """value, checked against the field's type, choices and range (an int where a float is
    asked for becomes a float); a UserError that says what is wrong."""
    name, listed = field.name, choices(typ)
    if listed is not None:
        if value not in listed:
            raise UserError(f"{name}={value!r} is not one of {', '.join(map(repr, listed))}")
        return value
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if typ is int and isinstance(value, bool) or not isinstance(value, typ):
        example = {bool: "True", int: "8", float: "3e-4", str: "text"}[typ]
        raise UserError(f"{name} must be {typ.__name__}, got {value!r} ({type(value).__name__}); "
                        f"for example --{name}={example}")
    meta = field.metadata
    if typ in (int, float) and bounds_text(meta):
        ok = math.isfinite(value) and \
            value >= meta.get("at_least", -math.inf) and value > meta.get("above", -math.inf) \
            and value < meta.get("below", math.inf) and value <= meta.get("at_most", math.inf)
        if not ok:
            raise UserError(f"{name}={value!r} must be {bounds_text(meta)} ({name}: "
                            f"{meta.get('help', '')})")
    return value


def check(cfg):
    """Check every field of a settings dataclass; its __post_init__ calls this."""
    hints = typing.get_type_hints(type(cfg))
    for field in dataclasses.fields(cfg):
        setattr(cfg, field.name, check_value(field, hints[field.name], getattr(cfg, field.name)))


def check_only_for(cfg, name, key, wanted):
    """A key that only key=wanted reads, set in a run where key is another value, would be
    ignored without a word: refused."""
    default = next(f.default for f in dataclasses.fields(cfg) if f.name == name)
    value, actual = getattr(cfg, name), getattr(cfg, key)
    if actual != wanted and value != default:
        raise UserError(f"{name}={value!r} is a setting of {key}={wanted!r}, and this run is "
                        f"{key}={actual!r}: add --{key}={wanted}, or leave {name} out.")


# ---- reading config files and arguments ----

def read_config_file(path):
    if not os.path.isfile(path):
        raise UserError(f"config file {path} does not exist (config files are paths such "
                        f"as config/quickstart.py; settings are given as --key=value)")
    scope = {}
    try:
        with open(path) as f:
            exec(compile(f.read(), path, "exec"), scope)
    except SyntaxError as e:
        raise UserError(f"config file {path} does not parse: line {e.lineno}: {e.msg}") from e
    except Exception as e:
        raise UserError(f"config file {path} failed while running: "
                        f"{type(e).__name__}: {e}") from e
    return {k: v for k, v in scope.items() if not k.startswith("_")
            and not isinstance(v, (types.ModuleType, types.FunctionType, type))}


def parse_value(raw, typ):
    typ = type(choices(typ)[0]) if choices(typ) else typ  # a Literal's: its choices' type
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = None
    if typ is str and not isinstance(value, str):  # --out_dir=out-2 and --start=42 are text
        return raw
    if value is None:
        raise UserError(f"cannot read the value {raw!r}")
    return value


def arguments(argv, hints, positional=()):
    """(key, raw value or None, where) of each --key=value, --key value or --flag, and
    (None, path, where) of each config file, in order; then the others (not .py) as positional's
    keys, one each (more are config files), or all as a lone key's, comma-separated."""
    i, bare = 0, []
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") and not arg.endswith(".py") and \
                (len(bare) < len(positional) or len(positional) == 1):
            bare.append(arg)
        elif not arg.startswith("--"):
            yield None, arg, f"config file {arg}"
        else:
            key, sep, raw = arg[2:].partition("=")
            if not sep and hints.get(key) is not bool and i + 1 < len(argv) and \
                    not argv[i + 1].startswith("--"):
                i, raw = i + 1, argv[i + 1]  # argparse's --key value
            elif not sep:
                raw = "True" if hints.get(key) is bool else None
            yield key, raw, f"argument {arg}"
        i += 1
    values = [",".join(bare)] if len(positional) == 1 and bare else bare
    yield from ((k, raw, f"argument {raw}") for k, raw in zip(positional, values))


def parse_given(config_cls, argv, script):
    """(the configuration, {each key that config files and arguments set: where it was last
    set}, in the order they were last set): a run that takes its architecture from weights
    must tell a key the user chose from a default, and one of two keys that replace each other
    (data_dir, data_mix) the later. -h or --help prints the keys and exits, as argparse does.
    A problem is a SettingsError: every rank reads the same arguments and files."""
    if any(arg in ("-h", "--help") for arg in argv):
        print(help_text(config_cls, script))
        raise SystemExit(0)
    try:
        return read_settings(config_cls, argv, script)
    except UserError as e:
        raise SettingsError(str(e)) from None


def read_settings(config_cls, argv, script):
    hints = typing.get_type_hints(config_cls)
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    values, given = {}, {}
    for key, raw, where in arguments(argv, hints, getattr(config_cls, "POSITIONAL", ())):
        pairs = read_config_file(raw).items() if key is None else [(key, raw)]
        for name, value in pairs:
            if name not in fields:
                close = [f"{n} (its new name)" for n, f in fields.items()
                         if f.metadata.get("was") == name] \
                    or difflib.get_close_matches(name, fields, n=3, cutoff=0.6)
                hint = f"did you mean {' or '.join(close)}? " if close else ""
                raise UserError(f"{where}: unknown key {name!r}; {hint}`python {script} --help` "
                                f"lists the keys.")
            try:
                if key is not None:
                    if value is None:
                        raise UserError("settings are written --key=value")
                    value = parse_value(value, hints[name])
                values[name] = check_value(fields[name], hints[name], value)
            except UserError as e:
                raise UserError(f"{where}: {e}") from None
            given.pop(name, None)
            given[name] = where
    return config_cls(**values), given


def parse(config_cls, argv, script):
    """An instance of config_cls from its defaults, config files and --key=value arguments."""
    return parse_given(config_cls, argv, script)[0]


def end_now_if_unreadable(config_cls, argv, script):
    """Read the settings before the script's slow imports (torch's takes seconds): a mistyped
    key or a bad value ends the process in a moment, reported as errors.run reports it in
    main(), and --help prints at once. main() reads them again, after the imports."""
    def read(argv):  # None: exit status 0
        parse_given(config_cls, argv, script)

    if status := errors.run(read, script, argv):
        raise SystemExit(status)


# ---- describing ----

def describe(cfg):
    """The effective configuration, one key per line, for the log."""
    return "\n".join(f"  {f.name} = {getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg))


def help_text(config_cls, script):
    """--help: the script's usage, then each key with its type, range, default and help."""
    hints, positional = typing.get_type_hints(config_cls), getattr(config_cls, "POSITIONAL", ())
    bare = "".join(f" [{k}{' ...' * (len(positional) == 1)}]" for k in positional)
    lines = [f"usage: python {script} [config files] [--key=value ...]{bare}", "",
             inspect.cleandoc(config_cls.__doc__ or ""), "",
             "Config files (python that assigns keys) and --key=value apply in order. Keys:"]
    for f in dataclasses.fields(config_cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        kind = ", ".join(filter(None, [type_name(hints[f.name]), bounds_text(f.metadata)]))
        lines.append(f"  --{f.name}={default!r}  ({kind})")
        lines.append(textwrap.fill(f.metadata.get("help", ""), width=99,
                                   initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines)
