"""The CLI's one runner and its output helper (claimkit.cli.common.run, claimkit.cli.runner),
and the live view drawn for each watch frame (claimkit.cli.inspect_command.watch_view)."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

import pytest
import typer
from rich.console import Console

from claimkit.cli.common import EXIT_INTERRUPTED, Interrupt, run
from claimkit.cli.inspect_command import watch_view
from claimkit.cli.runner import show
from claimkit.ops.watch import WatchFrame

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable


async def _interrupted() -> int:
    raise KeyboardInterrupt


async def _interrupted_in_group() -> int:
    raise BaseExceptionGroup("tasks", [KeyboardInterrupt()])


async def _answer() -> int:
    return 7


@pytest.mark.parametrize("fn", [_interrupted, _interrupted_in_group])
def test_ctrl_c_stop_ends_quietly(
    fn: Callable[[], Awaitable[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(fn, url="redis://x", interrupt=Interrupt.STOP) is None
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("fn", [_interrupted, _interrupted_in_group])
def test_ctrl_c_fail_is_one_line_and_130(
    fn: Callable[[], Awaitable[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(typer.Exit) as exc:
        run(fn, url="redis://x", interrupt=Interrupt.FAIL)
    assert exc.value.exit_code == EXIT_INTERRUPTED
    assert capsys.readouterr().err == (
        "claimkit: interrupted; batches already done stay done, run it again to finish\n"
    )


def test_ctrl_c_raise_propagates() -> None:
    with pytest.raises(KeyboardInterrupt):
        run(_interrupted, url="redis://x")


def test_run_returns_the_result() -> None:
    assert run(_answer, url="redis://x", interrupt=Interrupt.FAIL) == 7


def test_show_prints_strict_json_or_text_lines(capsys: pytest.CaptureFixture[str]) -> None:
    show(True, doc=lambda: {"x": float("inf"), "n": 1}, text=lambda: "unused")
    assert capsys.readouterr().out == '{\n  "x": "inf",\n  "n": 1\n}\n'
    show(False, doc=lambda: None, text=lambda: ["one", "two"])
    assert capsys.readouterr().out == "one\ntwo\n"
    show(False, doc=lambda: None, text=lambda: "[not markup]")
    assert capsys.readouterr().out == "[not markup]\n"


def _text(view: object) -> str:
    out = io.StringIO()
    Console(file=out, width=200).print(view)
    return out.getvalue()


def _frame(**kw: object) -> WatchFrame:
    fields: dict[str, object] = {
        "snapshot": None,
        "read_at": 0.0,
        "now": 3.0,
        "failure": None,
        "hung": False,
        "trouble_since": None,
    }
    fields.update(kw)
    return WatchFrame(**fields)  # type: ignore[arg-type]


def test_watch_view_before_the_first_read() -> None:
    assert watch_view(_frame(), None, url="redis://h") is None
    assert watch_view(_frame(hung=True), None, url="redis://h") is None  # no start known
    assert _text(
        watch_view(_frame(failure="refused", trouble_since=1.0), None, url="redis://h")
    ) == ("Redis at redis://h is unavailable: refused; retrying\n")
    assert _text(watch_view(_frame(hung=True, trouble_since=1.0), None, url="redis://h")) == (
        "Redis at redis://h not answering since 00:00:01Z; waiting\n"
    )


def test_watch_view_marks_an_old_view_stale() -> None:
    fresh = watch_view(_frame(), "VIEW", url="redis://h")
    assert _text(fresh) == "read 00:00:00Z, 3.0s ago\nVIEW\n"
    failed = watch_view(_frame(failure="refused", trouble_since=2.0), "VIEW", url="redis://h")
    assert _text(failed) == (
        "STALE: Redis at redis://h unavailable since 00:00:02Z: refused; retrying. "
        "Below: the view read 00:00:00Z, 3.0s ago\nVIEW\n"
    )
    hung = watch_view(_frame(hung=True, trouble_since=2.0), "VIEW", url="redis://h")
    assert _text(hung) == (
        "STALE: Redis at redis://h not answering since 00:00:02Z; retrying. "
        "Below: the view read 00:00:00Z, 3.0s ago\nVIEW\n"
    )
