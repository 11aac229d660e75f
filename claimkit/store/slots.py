"""Redis Cluster hash slots: which arguments of a command are keys, and a key's slot
(docs/topology.md#cluster-key-layout)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from coredis._utils import hash_slot

from claimkit.store.interface import reply_text

if TYPE_CHECKING:
    from collections.abc import Sequence

    from claimkit.store.interface import Arg

__all__ = ["SLOTS", "key_positions", "key_slot"]

SLOTS = 16384
"""How many hash slots a Redis Cluster has."""

_SCRIPT_CALLS = frozenset({"EVAL", "EVALSHA", "EVAL_RO", "EVALSHA_RO", "FCALL", "FCALL_RO"})
_KEYLESS = frozenset(
    {
        "ACL",
        "CLIENT",
        "CLUSTER",
        "COMMAND",
        "CONFIG",
        "DBSIZE",
        "DISCARD",
        "ECHO",
        "EXEC",
        "FLUSHALL",
        "FLUSHDB",
        "FUNCTION",
        "HELLO",
        "INFO",
        "LASTSAVE",
        "MULTI",
        "PING",
        "PUBLISH",
        "RANDOMKEY",
        "ROLE",
        "SCAN",
        "SCRIPT",
        "SLOWLOG",
        "TIME",
        "UNWATCH",
        "WAIT",
        "WAITAOF",
    }
)
_ALL_KEYS = frozenset(
    {"DEL", "UNLINK", "EXISTS", "MGET", "TOUCH", "WATCH", "SINTER", "SUNION", "SDIFF", "PFCOUNT"}
)
_TWO_KEYS = frozenset(
    {"BLMOVE", "LMOVE", "RPOPLPUSH", "BRPOPLPUSH", "SMOVE", "RENAME", "RENAMENX", "COPY"}
)
_STORE_NUMKEYS = frozenset({"ZUNIONSTORE", "ZINTERSTORE", "ZDIFFSTORE"})
_SUBCOMMAND_KEY = frozenset({"OBJECT", "MEMORY", "XINFO"})


def key_slot(key: str | bytes) -> int:
    """The hash slot of ``key`` (0-16383): CRC16 of its hash tag (the text between the
    first ``{`` and the first ``}`` after it, when not empty), else of the whole name."""
    return int(hash_slot(key.encode() if isinstance(key, str) else key))


def key_positions(args: Sequence[Arg]) -> list[int]:
    """The indexes in ``args`` (``args[0]`` the command's name) of the arguments that are
    keys, for the commands claimkit sends: ``EVALSHA sha 2 k1 k2 a`` -> ``[3, 4]``;
    ``ZADD q 1 m`` -> ``[1]``; ``TIME`` -> ``[]``."""
    if not args:
        return []
    name = reply_text(args[0]).upper()
    count = len(args)
    if name in _SCRIPT_CALLS:
        try:
            numkeys = int(reply_text(args[2]))
        except (IndexError, ValueError):
            return []
        return list(range(3, min(count, 3 + numkeys)))
    if name in _KEYLESS or count < 2:
        return []
    if name in _ALL_KEYS:
        return list(range(1, count))
    if name in ("MSET", "MSETNX"):
        return list(range(1, count, 2))
    if name in _TWO_KEYS:
        return list(range(1, min(count, 3)))
    if name in _STORE_NUMKEYS:
        try:
            numkeys = int(reply_text(args[2]))
        except (IndexError, ValueError):
            return [1]
        return [1, *range(3, min(count, 3 + numkeys))]
    if name in _SUBCOMMAND_KEY:
        return [2] if count > 2 else []
    return [1]
