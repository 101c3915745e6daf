"""docs/cli.md is what the parsers say now (regenerate with `make docs`)."""
from __future__ import annotations

from pathlib import Path

from coordinator.cli.reference import render

CLI_MD = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def test_the_committed_cli_reference_is_current():
    assert CLI_MD.read_text() == render(), "docs/cli.md is stale: run `make docs` and commit it"


def test_the_reference_covers_every_command_and_a_flag_of_each():
    text = render()
    for command, flag in (("run", "--max-new-tokens"), ("local", "--http-port"), ("generate", "--addr"),
                          ("bench", "--simulate"), ("bench-hop", "--rows"), ("stage", "--next-hop"),
                          ("coordinator", "--api-max-concurrent-rpcs")):
        section = text.split(f"## specpipe {command}\n", 1)[1].split("\n## ", 1)[0]
        assert flag in section, (command, flag)
