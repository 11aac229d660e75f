"""Errors every layer may raise, defined below all of them (it imports nothing of claimkit),
and :func:`exception_chain`, which every layer uses to find the OS error behind a failure.

:class:`ConfigError` is raised by the config layer (a bad field) and by the store layer (a
store backend that cannot be used here), so it cannot live in either one without an upward
import. ``claimkit.config`` and ``claimkit`` re-export it: import it from there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["ConfigError", "exception_chain"]


class ConfigError(ValueError):
    """The configuration is unusable; ``str(err)`` is one line naming the field."""


ConfigError.__module__ = "claimkit.config"


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception behind it (``__cause__``, ``__context__``, the members
    of exception groups), each once, outermost first. Used to find the OS error (and its
    errno) under a library's own exception, e.g. ``EMFILE`` under a connect error
    (docs/dispatch.md#out-of-open-files)."""
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        cur = stack.pop()
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        yield cur
        if isinstance(cur, BaseExceptionGroup):
            stack.extend(reversed(cur.exceptions))
        stack.extend(nxt for nxt in (cur.__cause__, cur.__context__) if nxt is not None)
