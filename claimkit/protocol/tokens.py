"""Ownership tokens: one fresh token per claim (docs/protocol.md#ownership-tokens).

A token fences every later step of its claim (renew, ack, park, release compare it for
equality only); claimkit's tokens are UUIDv7s that also say when the claim was taken.
"""

from __future__ import annotations

import re
import secrets
import time

__all__ = ["new_token", "token_time"]

_TOKEN_TAG = 0xC1
"""The first 8 of the 12 ``rand_a`` bits of claimkit's tokens: with the version and variant
bits it makes a random 128-bit token pass :func:`token_time` once in 16,384 tries."""

_TOKEN_HEX = re.compile(r"[0-9a-f]{12}7c1[0-9a-f][89ab][0-9a-f]{15}")

_EARLIEST_STAMP = 1_600_000_000.0
"""2020-09-13: an older stamp is not a claim time (a foreign token that matched by chance)."""


def new_token(now: float | None = None) -> str:
    """A fresh ownership token: a UUIDv7 (RFC 9562) as 32 lower-case hex chars.

    48 bits of Unix time in milliseconds, the version (7) and variant bits, a tag byte
    (:data:`_TOKEN_TAG`) and 66 random bits, so it stays unguessable (at least 64 random
    bits, docs/protocol.md#ownership-tokens) and also says when the claim was taken:
    :func:`token_time` reads it back for ``claimkit inspect``. Fencing compares tokens for
    equality only; the time in a token never decides anything.

    Args:
        now: Unix seconds to stamp, ideally the Redis server clock as the caller estimates
            it; this machine's clock when ``None``.
    """
    ms = int((time.time() if now is None else now) * 1000) & 0xFFFF_FFFF_FFFF
    rand = int.from_bytes(secrets.token_bytes(9), "big") & ((1 << 66) - 1)
    rand_a = (_TOKEN_TAG << 4) | (rand >> 62)
    rand_b = rand & ((1 << 62) - 1)
    value = (ms << 80) | (0x7 << 76) | (rand_a << 64) | (0b10 << 62) | rand_b
    return f"{value:032x}"


def token_time(token: str) -> float | None:
    """The Unix seconds a :func:`new_token` token was stamped with, or ``None`` when
    ``token`` is not one (another consumer's token, or one from before claimkit stamped
    them) or its stamp is older than 2020. Callers should also distrust a stamp far ahead
    of the server clock."""
    if _TOKEN_HEX.fullmatch(token) is None:
        return None
    stamp = int(token[:12], 16) / 1000
    return stamp if stamp >= _EARLIEST_STAMP else None
