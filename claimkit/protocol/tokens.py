"""Ownership tokens: one fresh token per claim (docs/protocol.md#ownership-tokens).

A token fences every later step of its claim (renew, ack, park, release compare it for
equality only). claimkit's tokens are ``<consumer id>/<UUIDv7 hex>``: the consumer id says
which ``claimkit serve`` holds the claim (docs/protocol.md#consumers), the UUIDv7 when the
claim was taken, and its random bits keep the token fresh and unguessable.
"""

from __future__ import annotations

import re
import secrets
import time

__all__ = [
    "CONSUMER_ID_PATTERN",
    "consumer_id_problem",
    "new_token",
    "token_consumer",
    "token_time",
]

_TOKEN_TAG = 0xC1
"""The first 8 of the 12 ``rand_a`` bits of claimkit's tokens: with the version and variant
bits it makes a random 128-bit token pass :func:`token_time` once in 16,384 tries."""

_TOKEN_HEX = re.compile(r"[0-9a-f]{12}7c1[0-9a-f][89ab][0-9a-f]{15}")

CONSUMER_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,126}"
"""What a consumer id may be (docs/cli.md#claimkit-serve): 1 to 127 characters, letters,
digits, ``.``, ``_`` and ``-``, starting with a letter or a digit; never a ``/``, which
separates it from the rest of a token."""

_CONSUMER_ID = re.compile(CONSUMER_ID_PATTERN)

_EARLIEST_STAMP = 1_600_000_000.0
"""2020-09-13: an older stamp is not a claim time (a foreign token that matched by chance)."""


def consumer_id_problem(consumer_id: str) -> str | None:
    """Why ``consumer_id`` cannot be a consumer id (one line), or ``None`` when it can
    (:data:`CONSUMER_ID_PATTERN`)."""
    if _CONSUMER_ID.fullmatch(consumer_id) is not None:
        return None
    return (
        f"consumer id {consumer_id!r} must be 1 to 127 letters, digits, '.', '_' or '-', "
        "starting with a letter or a digit"
    )


def _uuid7_hex(now: float | None) -> str:
    ms = int((time.time() if now is None else now) * 1000) & 0xFFFF_FFFF_FFFF
    rand = int.from_bytes(secrets.token_bytes(9), "big") & ((1 << 66) - 1)
    rand_a = (_TOKEN_TAG << 4) | (rand >> 62)
    rand_b = rand & ((1 << 62) - 1)
    value = (ms << 80) | (0x7 << 76) | (rand_a << 64) | (0b10 << 62) | rand_b
    return f"{value:032x}"


def new_token(consumer_id: str | None = None, *, now: float | None = None) -> str:
    """A fresh ownership token: ``<consumer_id>/<32 hex chars>``, or the 32 hex chars alone
    when ``consumer_id`` is ``None`` (a token no consumer owns: result readers, outbox
    fields).

    The hex part is a UUIDv7 (RFC 9562): 48 bits of Unix time in milliseconds, the version
    (7) and variant bits, a tag byte (:data:`_TOKEN_TAG`) and 66 random bits, so the token
    stays unguessable (at least 64 random bits, docs/protocol.md#ownership-tokens) and also
    says when the claim was taken. :func:`token_time` and :func:`token_consumer` read it
    back for ``claimkit inspect`` and ``claimkit consumers``; the reclaimer's fast failover
    finds a dead consumer's claims by the id (docs/protocol.md#fast-failover). Fencing
    compares whole tokens for equality only.

    Args:
        consumer_id: the id of the consumer taking the claim (:func:`consumer_id_problem`
            must accept it), or ``None``.
        now: Unix seconds to stamp, ideally the Redis server clock as the caller estimates
            it; this machine's clock when ``None``.

    Raises:
        ValueError: ``consumer_id`` is not a valid consumer id.
    """
    hex_part = _uuid7_hex(now)
    if consumer_id is None:
        return hex_part
    problem = consumer_id_problem(consumer_id)
    if problem is not None:
        raise ValueError(problem)
    return f"{consumer_id}/{hex_part}"


def _split(token: str) -> tuple[str | None, str]:
    head, sep, tail = token.rpartition("/")
    if sep and _CONSUMER_ID.fullmatch(head) is not None:
        return head, tail
    return None, token


def token_consumer(token: str) -> str | None:
    """The consumer id of a :func:`new_token` token (``"pod-a/0190..."`` -> ``"pod-a"``),
    or ``None`` when ``token`` names none: a bare-hex token from before claimkit stamped
    consumer ids, or another program's token."""
    consumer, rest = _split(token)
    if consumer is None or _TOKEN_HEX.fullmatch(rest) is None:
        return None
    return consumer


def token_time(token: str) -> float | None:
    """The Unix seconds a :func:`new_token` token was stamped with (with or without its
    consumer id), or ``None`` when ``token`` is not one (another program's token) or its
    stamp is older than 2020. Callers should also distrust a stamp far ahead of the server
    clock."""
    _consumer, rest = _split(token)
    if _TOKEN_HEX.fullmatch(rest) is None:
        return None
    stamp = int(rest[:12], 16) / 1000
    return stamp if stamp >= _EARLIEST_STAMP else None
