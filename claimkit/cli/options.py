"""The options the operator commands share beyond the config's (docs/cli.md)."""

from __future__ import annotations

from typing import Annotated

import typer

__all__ = ["JsonOut", "Queue"]

Queue = Annotated[
    str,
    typer.Option("--queue", "-q", help="The queue (pending ZSET) name.", show_default=False),
]
JsonOut = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of text.")]
