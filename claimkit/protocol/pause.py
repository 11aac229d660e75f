"""A queue's pause mark: what the key ``<q>:paused`` holds (docs/protocol.md#pause).

While ``<q>:paused`` exists, no consumer claims anything new from ``<q>``; whatever it
holds. ``claimkit pause`` writes JSON ``{"since": <Unix seconds>, "reason": <text or
null>}`` (``"until"`` added when it resumes by itself), times on the Redis server clock;
:func:`parse_pause` reads any value, a hand-made ``SET q:paused 1`` included.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["PauseMark", "parse_pause"]


@dataclass(frozen=True, slots=True)
class PauseMark:
    """A paused queue's mark, as read from ``<q>:paused``.

    Attributes:
        since: when it was paused, Unix seconds on the Redis server clock; ``None`` when
            the value does not say (a key set by hand).
        reason: the operator's ``--reason``, or ``None``.
        until: when the key expires and the queue resumes by itself (``--for``), Unix
            seconds on the server clock; ``None`` when it stays until ``claimkit resume``.
    """

    since: float | None = None
    reason: str | None = None
    until: float | None = None

    def encode(self) -> bytes:
        """The key's value: compact JSON, keys ``since``, ``reason`` and (when set)
        ``until``, in that order."""
        doc: dict[str, Any] = {"since": self.since, "reason": self.reason}
        if self.until is not None:
            doc["until"] = self.until
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()

    def to_json(self) -> dict[str, Any]:
        """This mark in ``--json`` output: ``since``, ``reason``, ``until`` (each may be
        ``null``)."""
        return {"since": self.since, "reason": self.reason, "until": self.until}


def _time(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def parse_pause(raw: bytes | str | None) -> PauseMark | None:
    """The mark ``<q>:paused`` holds, or ``None`` when the key is absent (``raw`` is
    ``None``). Never raises: a value that is not claimkit's JSON (``"1"``, a bad
    ``since``) still pauses the queue, with the fields it could not read as ``None``."""
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return PauseMark()
    if not isinstance(doc, dict):
        return PauseMark()
    reason = doc.get("reason")
    return PauseMark(
        since=_time(doc.get("since")),
        reason=reason if isinstance(reason, str) and reason else None,
        until=_time(doc.get("until")),
    )
