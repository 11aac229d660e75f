"""The producer side (SPEC §2.2): submit, cancel and read results."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from . import _keys
from ._models import TerminalRecord

if TYPE_CHECKING:
    from ._store import Arg, Store

__all__ = ["CANCEL_TTL_SECONDS", "Producer", "SubmitError"]

CANCEL_TTL_SECONDS = 604800  # 7 days (SPEC §1, request-cancel:<id>)


class SubmitError(ValueError):
    """A request was refused before anything was written (SPEC §2.2 messages)."""


def _server_now(reply: Any) -> float:
    return int(reply[0]) + int(reply[1]) / 1_000_000


class Producer:
    """Puts requests on a queue and reads their terminal records.

    Args:
        store: an open :class:`~claimkit._store.Store`.
        queue: the pending ZSET ``<q>``.
        result_list: the list :meth:`results` reads (default ``result-list``).
    """

    def __init__(self, store: Store, queue: str, *, result_list: str = "result-list") -> None:
        self.store = store
        self.queue = queue
        self.result_list = result_list

    @staticmethod
    def envelope(request: Mapping[str, Any], token: str) -> dict[str, Any]:
        """The envelope for ``request``: either a whole envelope (it has ``data``) or just its
        ``data`` object. ``internal.request_token`` is set to ``token``; every other field is
        kept as given."""
        if "data" in request:
            doc = dict(request)
            internal = dict(doc.pop("internal", None) or {})
        else:
            doc = {"request_kind": "plain", "data": dict(request)}
            internal = {}
        internal["request_token"] = token
        return {"internal": internal, "request_kind": doc.pop("request_kind", "plain"), **doc}

    @staticmethod
    def _check(data: Any, now: float) -> tuple[str, int]:
        if not isinstance(data, Mapping):
            raise SubmitError("request data must be a JSON object")
        rid = data.get("id")
        if not isinstance(rid, str) or not rid:
            raise SubmitError("request ID is required")
        deadline = data.get("deadline")
        if isinstance(deadline, bool) or not isinstance(deadline, int) or deadline <= 0:
            raise SubmitError("deadline is required")
        if deadline <= now:
            raise SubmitError("deadline has already expired")
        return rid, deadline

    async def submit_many(self, requests: Iterable[Mapping[str, Any]]) -> list[str]:
        """Submit requests atomically, all or none, in one MULTI/EXEC (SPEC §2.2).

        Each request is an envelope or a bare ``data`` object with ``id`` (non-empty string)
        and ``deadline`` (integer Unix seconds, in the future by the Redis server clock).

        Returns:
            The generated ``request_token`` of each request, in order.

        Raises:
            SubmitError: a request is invalid (nothing was written).
            StoreUnavailable, StoreError: from the store.
        """
        now_reply, kind = await self.store.pipeline(
            [["TIME"], ["TYPE", self.queue]], transaction=False
        )
        now = _server_now(now_reply)
        kind = kind.decode() if isinstance(kind, bytes) else str(kind)
        if kind not in ("zset", "none"):
            # Checked first: MULTI/EXEC does not roll back, so a failing ZADD would leave the
            # request-active marker of a request that was never queued.
            raise SubmitError(f"queue key {self.queue!r} holds a {kind}, not a sorted set")
        commands: list[list[Arg]] = []
        tokens: list[str] = []
        for request in requests:
            token = secrets.token_hex(16)
            doc = self.envelope(request, token)
            rid, deadline = self._check(doc.get("data"), now)
            member = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
            commands += [
                ["DEL", _keys.request_cancel(rid)],
                ["SET", _keys.request_active(rid), token, "PXAT", deadline * 1000],
                ["ZADD", self.queue, deadline, member],
            ]
            tokens.append(token)
        if commands:
            await self.store.pipeline(commands, transaction=True)
        return tokens

    async def submit(self, request: Mapping[str, Any]) -> str:
        """Submit one request; see :meth:`submit_many`. Returns its ``request_token``."""
        return (await self.submit_many([request]))[0]

    async def cancel(self, request_id: str) -> bool:
        """Cancel a request (SPEC §2.2): if ``request-active:<id>`` exists, copy its token to
        ``request-cancel:<id>`` with a 7-day TTL. Returns whether a live request was found.
        The consumer then ends it with a ``CANCELLED`` record when it next meets it."""
        token = await self.store.command("GET", _keys.request_active(request_id))
        if token is None:
            return False
        await self.store.command(
            "SET", _keys.request_cancel(request_id), token, "EX", CANCEL_TTL_SECONDS
        )
        return True

    async def results(self, count: int = 100, *, peek: bool = False) -> list[TerminalRecord]:
        """Up to ``count`` records, oldest first. ``peek=True`` reads without removing."""
        if peek:
            raw = await self.store.command("LRANGE", self.result_list, -count, -1)
            raw = list(reversed(raw))
        else:
            raw = await self.store.command("RPOP", self.result_list, count) or []
        return [TerminalRecord.from_json(r) for r in raw]
