"""Settings declared once: a dataclass field made with `option` carries its type, default and help; its
command-line flag (`--field-name`) and the environment variable that sets its default (`SPECPIPE_FIELD_NAME`)
are derived from it, as are the values `from_args` passes back to the dataclass.

>>> @dataclass(frozen=True)
... class Demo:
...     width: int = option(32, "tree nodes per step")
...     namespace: str = option("", env="POD_NAMESPACE")
...     retries: int = 3                                # a plain field: no flag
>>> p = argparse.ArgumentParser()
>>> add_options(p, Demo)
>>> values(Demo, p.parse_args(["--width", "4"]))
{'width': 4, 'namespace': ''}
>>> [(flag_of(f), env_of(f)) for f in options(Demo)]
[('--width', 'SPECPIPE_WIDTH'), ('--namespace', 'POD_NAMESPACE')]

An environment variable replaces the default when the parser is built: with SPECPIPE_WIDTH=8 in the
environment `--width` defaults to 8, and a flag on the command line still wins.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, field, fields, is_dataclass
from typing import Any

PREFIX = "SPECPIPE_"
_KEY = "specpipe.option"
_DERIVED = "derived"                        # env=_DERIVED: SPECPIPE_<NAME>


def parse_bool(text: str | bool) -> bool:
    """A boolean flag's or environment variable's value: true/false, 1/0, yes/no, on/off.

    >>> parse_bool("off"), parse_bool("1")
    (False, True)
    """
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true or false)")


_TYPES: dict[object, Callable[[str], Any]] = {"int": int, "float": float, "str": str, "bool": parse_bool, int: int,
                                              float: float, str: str, bool: parse_bool}


@dataclass(frozen=True)
class Option:
    """How one field appears on the command line (kept in the field's metadata)."""
    help: str | None
    flag: str | None                       # None: --field-name
    env: str | None                        # None: no environment variable
    argparse: Mapping[str, Any]            # further add_argument keywords: choices, type, action, metavar, ...


def option(default: Any, /, help: str | None = None, *, flag: str | None = None, env: str | None = _DERIVED,
           **argparse_kw: Any) -> Any:
    """A dataclass field that is also a flag. `env=None`: no environment variable; `env="NAME"`: that one
    instead of SPECPIPE_<FIELD>. Keywords beyond these go to `add_argument` (choices, type, action, ...; a
    `default` there is the flag's alone)."""
    return field(default=default, metadata={_KEY: Option(help, flag, env, argparse_kw)})


def env_name(name: str) -> str:
    """The environment variable of a field, unless it names another.

    >>> env_name("tree_policy")
    'SPECPIPE_TREE_POLICY'
    """
    return PREFIX + name.upper()


def options(cls: type, own: bool = False) -> list[Field]:
    """The fields of `cls` made with `option`, in declaration order (inherited ones first); `own`: only
    those `cls` itself declares."""
    inherited = {f.name for b in cls.__mro__[1:] if is_dataclass(b) for f in fields(b)} if own else set()
    return [f for f in fields(cls) if _KEY in f.metadata and f.name not in inherited]


def flag_of(f: Field) -> str:
    return f.metadata[_KEY].flag or "--" + f.name.replace("_", "-")


def env_of(f: Field) -> str | None:
    env = f.metadata[_KEY].env
    return env_name(f.name) if env == _DERIVED else env


def add_flag(p: argparse.ArgumentParser, flag: str, default: Any, help: str | None = None, *,
             env: str | None = None, type: Callable[[str], Any] = str, **kw: Any) -> None:
    """One flag whose default the environment variable `env` (when set) replaces, read now."""
    if env is not None and env in os.environ:
        default = type(os.environ[env])
    p.add_argument(flag, type=type, default=default, help=help, **kw)


def add_options(p: argparse.ArgumentParser, cls: type, *, own: bool = False,
                after: Mapping[str, Callable[[argparse.ArgumentParser], None]] | None = None) -> None:
    """A flag for each option of `cls`, in declaration order; `after[name](p)` adds more right after the
    flag of field `name` (for flags of other classes, or ones that are not fields, to keep --help's order).
    The flag's default is the field's in the flag's type; a tuple field's flag takes a comma-separated string
    (the dataclass or `from_args` splits it)."""
    for f in options(cls, own):
        o: Option = f.metadata[_KEY]
        kw = {"type": _TYPES.get(f.type, str), "dest": f.name, **o.argparse}
        default = ",".join(f.default) if isinstance(f.default, tuple) else kw["type"](f.default)
        add_flag(p, flag_of(f), kw.pop("default", default), o.help, env=env_of(f), **kw)
        if after and f.name in after:
            after[f.name](p)


def values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The parsed value of every option of `cls` (inherited ones too), by field name."""
    return {f.name: getattr(args, f.name) for f in options(cls)}


def service_parser(prog: str, description: str, examples: str, *env: str) -> argparse.ArgumentParser:
    """The parser of a service's entry point (`specpipe stage`, `specpipe coordinator`): its --help ends with
    the examples, then a line on the environment naming a few of its variables (`env`)."""
    return argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"{examples}Most options also read {PREFIX}<OPTION> from the environment ({', '.join(env)}, ...).")
