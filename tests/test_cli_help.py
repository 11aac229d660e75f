"""``--help`` of every command and subcommand, read as a new user reads it on an 80-column
terminal, and ``--version`` (docs/cli.md).

Every help text cites ``docs/`` (never a SPEC a user cannot open), shows no ``<bool>``
metavar for a flag, fits 80 columns, and keeps each example line intact so it can be
pasted. A short flag means one thing across all commands.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import typer
from typer.testing import CliRunner

from claimkit.cli.app import app

if TYPE_CHECKING:
    from collections.abc import Iterator

runner = CliRunner()
CLAIMKIT = Path(sys.executable).with_name("claimkit")


def is_group(command: Any) -> bool:
    return hasattr(command, "commands")


def walk(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every command path under ``command``: ``()``, ``("serve",)``, ``("dead", "list")``."""
    yield path
    if is_group(command):
        for name, sub in command.commands.items():
            yield from walk(sub, (*path, name))


ROOT = typer.main.get_command(app)
PATHS = list(walk(ROOT))


def command_at(path: tuple[str, ...]) -> Any:
    command: Any = ROOT
    for name in path:
        assert is_group(command)
        command = command.commands[name]
    return command


def example_blocks(command: Any) -> list[list[str]]:
    """The verbatim blocks (click's ``\\b`` paragraphs) of a help text, line by line."""
    return [
        [line.strip() for line in paragraph.splitlines()[1:] if line.strip()]
        for paragraph in (command.help or "").split("\n\n")
        if paragraph.startswith("\b\n")
    ]


def help_at_80(path: tuple[str, ...]) -> str:
    result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    return result.stdout


def test_every_command_is_walked() -> None:
    names = {" ".join(p) for p in PATHS}
    for name in ("serve", "submit", "inspect", "results", "cancel", "dead list", "dead purge"):
        assert name in names


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "claimkit")
def test_help_reads_well_at_80_columns(path: tuple[str, ...]) -> None:
    text = help_at_80(path)
    assert "SPEC" not in text
    assert "<bool>" not in text
    # An option's value is named by what it is (SECONDS, PORT, N...), never typer's <type>.
    assert re.findall(r"--[a-z0-9-]+ <[^>]*>", text) == []
    assert "§" not in text
    too_wide = [line for line in text.splitlines() if len(line) > 80]
    assert too_wide == []
    command = command_at(path)
    if is_group(command):
        return
    blocks = example_blocks(command)
    assert blocks, f"claimkit {' '.join(path)} --help has no example"
    shown = [line.strip() for line in text.splitlines()]
    for block in blocks:
        for line in block:
            assert line in shown, f"example line broken or missing: {line!r}"
        # Each example is one command of this name; a continued one pastes as one
        # command: each line but the last ends in " \".
        assert block[0].startswith(f"claimkit {' '.join(path)} "), block
        assert all(line.endswith(" \\") for line in block[:-1]), block
        assert not block[-1].endswith("\\"), block


def test_flags_show_no_metavar() -> None:
    text = help_at_80(("results",)).split("\nOptions:\n", 1)[1]
    for flag in ("--pop", "--follow", "--peek", "--json", "--help"):
        (line,) = [row for row in text.splitlines() if row.strip().startswith(flag + " ")]
        assert line.split()[1][0].isupper(), line  # the help text follows the flag directly


def test_a_short_flag_means_one_thing_across_all_commands() -> None:
    meanings: dict[str, set[str]] = {}
    for path in PATHS:
        for param in command_at(path).params:
            if param.param_type_name != "option":
                continue
            longs = [opt for opt in param.opts if opt.startswith("--")]
            for short in (opt for opt in param.opts if not opt.startswith("--")):
                meanings.setdefault(short, set()).update(longs)
    assert {short: longs for short, longs in meanings.items() if len(longs) > 1} == {}
    assert meanings["-f"] == {"--file"}
    assert meanings["-q"] == {"--queue"}


def test_version_prints_the_package_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"claimkit {version('claimkit')}\n"


def test_the_console_script_answers_version_and_help() -> None:
    env = {**os.environ, "COLUMNS": "80"}
    shown = subprocess.run(
        [str(CLAIMKIT), "--version"], capture_output=True, text=True, env=env, timeout=60
    )
    assert (shown.returncode, shown.stdout, shown.stderr) == (
        0,
        f"claimkit {version('claimkit')}\n",
        "",
    )
    helped = subprocess.run(
        [str(CLAIMKIT), "results", "--help"], capture_output=True, text=True, env=env, timeout=60
    )
    assert helped.returncode == 0, helped.stderr
    assert "    claimkit results --redis-url redis://127.0.0.1:6379/0 --count 10\n" in helped.stdout
    assert max(len(line) for line in helped.stdout.splitlines()) <= 80
