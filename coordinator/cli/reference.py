"""docs/cli.md, generated from the argparse parsers themselves (one source for every flag, default and help):

    .venv/bin/python -m coordinator.cli.reference > docs/cli.md      # or: make docs

tests/test_cli_reference.py fails when the committed file differs from what this prints.
"""
from __future__ import annotations

import argparse
import os

WIDTH = "100"       # argparse wraps at $COLUMNS: fixed, so the file does not depend on the terminal

HEADER = """# Command-line reference

Generated from the parsers by `python -m coordinator.cli.reference` (`make docs`); do not edit by hand. Most
options of `specpipe stage` and `specpipe coordinator` also read `SPECPIPE_<OPTION>` from the environment.
"""


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def render() -> str:
    os.environ["COLUMNS"] = WIDTH
    from coordinator.cli.parsers import build_parser, _generate_parser
    from coordinator.frontends.server import build_parser as coordinator_parser
    from services.server import build_parser as stage_parser

    top = build_parser()
    commands = _subcommands(top)
    commands["generate"] = _subcommands(_generate_parser())["generate"]
    commands["stage"] = stage_parser()
    commands["coordinator"] = coordinator_parser()
    parts = [HEADER, "## specpipe\n", "```text\n" + top.format_help() + "```\n"]
    for name, parser in commands.items():
        parts += [f"## specpipe {name}\n", "```text\n" + parser.format_help() + "```\n"]
    return "\n".join(parts)


if __name__ == "__main__":
    print(render(), end="")
