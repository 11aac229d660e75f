"""The operator commands (docs/cli.md): ``inspect``, ``consumers``, ``drain``, ``reclaim``,
``dead``, ``results``, ``cancel``, ``pause`` and ``resume``, registered on the main app by
:func:`register`.

Each lives in its own module (:mod:`~claimkit.cli.inspect_command`,
:mod:`~claimkit.cli.consumers_command`,
:mod:`~claimkit.cli.drain_commands`, :mod:`~claimkit.cli.dead_commands`,
:mod:`~claimkit.cli.results_commands`, :mod:`~claimkit.cli.pause_commands`) and is a thin
layer over :mod:`claimkit.ops` through one skeleton (:mod:`claimkit.cli.runner`).

They share serve's configuration (docs/configuration.md: ``--transport-config``/``-file``,
``--redis-url``, ``$REDIS_URL``). A queue named with ``--queue`` must be one of the
configured queues when the config lists queues; with only a Redis URL any name is
accepted, and a key of the wrong Redis type is one error line. Every error is one line on
stderr: exit status 1 when the work could not be done (:func:`claimkit.cli.common.run`),
2 for a usage error (docs/cli.md, "Exit status"); passwords are never printed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from claimkit.cli.consumers_command import consumers
from claimkit.cli.dead_commands import dead_app
from claimkit.cli.drain_commands import drain, reclaim
from claimkit.cli.inspect_command import inspect_queue
from claimkit.cli.pause_commands import pause, resume
from claimkit.cli.results_commands import cancel, results

if TYPE_CHECKING:
    import typer

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    """Add the operator commands to ``app`` (called by :mod:`claimkit.cli.app`)."""
    app.command("inspect")(inspect_queue)
    app.command("consumers")(consumers)
    app.command("drain")(drain)
    app.command("pause")(pause)
    app.command("resume")(resume)
    app.command("reclaim")(reclaim)
    app.command("results")(results)
    app.command("cancel")(cancel)
    app.add_typer(dead_app, name="dead")
