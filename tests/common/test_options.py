"""common/options.py: a field declared once gives its flag, its environment variable and its help."""
from __future__ import annotations

import argparse
import doctest
from dataclasses import dataclass

import pytest

import common.options
from common.options import add_options, env_of, flag_of, option, options, values


@dataclass(frozen=True, kw_only=True)
class Base:
    color: str = option("red", "the base's color", choices=("red", "blue"))


@dataclass(frozen=True)
class Probe(Base):
    width: int = option(32, "tree nodes per step")
    ratio: float = option(0.5)
    names: tuple[str, ...] = option(("a", "b"), "comma-separated names")
    namespace: str = option("", "where it runs", env="POD_NAMESPACE")
    hidden: str = option("", argparse.SUPPRESS, env=None)
    retries: int = 3                                     # a plain field: no flag, no variable


def parser(cls: type = Probe, **kw) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_options(p, cls, **kw)
    return p


def test_a_field_added_gets_a_flag_an_environment_variable_and_its_help(monkeypatch):
    """One declaration: the flag is --field-name, the variable SPECPIPE_FIELD_NAME, the help the field's."""

    @dataclass(frozen=True)
    class Grown(Probe):
        new_knob: int = option(7, "a setting added later")

    help_text = parser(Grown).format_help()
    assert "--new-knob NEW_KNOB" in help_text and "a setting added later" in help_text
    assert parser(Grown).parse_args([]).new_knob == 7
    monkeypatch.setenv("SPECPIPE_NEW_KNOB", "11")
    assert parser(Grown).parse_args([]).new_knob == 11, "the variable sets the default"
    assert parser(Grown).parse_args(["--new-knob", "12"]).new_knob == 12, "the flag wins over the variable"
    cfg = Grown(**values(Grown, parser(Grown).parse_args([])))
    assert cfg.new_knob == 11 and cfg.retries == 3


def test_flags_and_variables_derive_from_the_field_names():
    assert [(f.name, flag_of(f), env_of(f)) for f in options(Probe)] == [
        ("color", "--color", "SPECPIPE_COLOR"), ("width", "--width", "SPECPIPE_WIDTH"),
        ("ratio", "--ratio", "SPECPIPE_RATIO"), ("names", "--names", "SPECPIPE_NAMES"),
        ("namespace", "--namespace", "POD_NAMESPACE"), ("hidden", "--hidden", None)]
    assert [f.name for f in options(Probe, own=True)] == ["width", "ratio", "names", "namespace", "hidden"]


def test_types_choices_tuples_and_order(monkeypatch):
    a = parser().parse_args(["--width", "4", "--ratio", "0.25", "--color", "blue"])
    assert (a.width, a.ratio, a.color, a.names) == (4, 0.25, "blue", "a,b")
    with pytest.raises(SystemExit):
        parser().parse_args(["--color", "green"])
    monkeypatch.setenv("SPECPIPE_RATIO", "0.75")
    monkeypatch.setenv("POD_NAMESPACE", "prod")
    monkeypatch.setenv("SPECPIPE_HIDDEN", "ignored")
    a = parser().parse_args([])
    assert (a.ratio, a.namespace, a.hidden) == (0.75, "prod", "")
    order = [o for o in parser(after={"width": lambda p: p.add_argument("--extra")}).format_usage().split()
             if o.startswith("[--")]
    assert order == ["[--color", "[--width", "[--extra", "[--ratio", "[--names", "[--namespace"]   # --hidden: no help


def test_doctests():
    assert doctest.testmod(common.options).failed == 0
