"""The Lua script registry: every script of ``lua/`` loaded once, by name
(docs/protocol.md#claim-protocol).

Scripts ship inside the wheel as ``claimkit/lua/*.lua`` (from the repository's top-level
``lua/``). A file named ``<verb>-<numkeys>.lua`` is a script; a file starting with ``_`` is
an include, pasted in where a script says ``-- @include _name``. Stores run a script with
EVALSHA and load it on NOSCRIPT, so a Redis restart or ``SCRIPT FLUSH`` costs one extra
round trip, never an error.

Every script's source starts with a shebang line, in every topology: :data:`SHEBANG`
(``#!lua``, no flags), or ``#!lua flags=no-writes`` for a read-only script whose file has
the line ``-- @flags no-writes``. With a shebang a Redis Cluster node refuses a script that
touches a key of another slot than its declared keys' (a script without one is let through
for backward compatibility), so no script can write one slot and then fail on another
(docs/topology.md#cluster-key-layout). Redis 7.0 or later (Valkey 7.2 or later) reads the
line. On a standalone server a script runs as it did without it, but for one thing: while
Redis is over ``maxmemory`` a script that may write is refused before it runs at all
(Redis's ``deny-oom`` default), where one without a shebang was refused at its first
write; either way nothing is written. A ``no-writes`` script still runs then.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["SHEBANG", "Script", "ScriptError", "all_scripts", "script"]

SHEBANG = "#!lua\n"
"""The first line of every script's source: Lua, no flags (Redis 7 ``EVAL`` shebang)."""

_NAME = re.compile(r"^(?P<verb>[a-z-]+)-(?P<numkeys>\d+)\.lua$")
_INCLUDE = re.compile(r"^-- @include (?P<name>_[a-z-]+)\s*$", re.MULTILINE)
_FLAGS = re.compile(r"^-- @flags (?P<flags>[a-z-]+(?:,[a-z-]+)*)\s*$", re.MULTILINE)
_KNOWN_FLAGS = frozenset({"no-writes", "allow-oom", "allow-stale", "no-cluster"})


class ScriptError(RuntimeError):
    """A Lua file is missing, misnamed or includes something that does not exist."""


@dataclass(frozen=True, slots=True)
class Script:
    """One loaded Lua script.

    Attributes:
        name: the verb, e.g. ``"claim"``.
        numkeys: how many ``KEYS`` the script declares (from its file name).
        source: the full Lua text sent to Redis: its shebang line (:data:`SHEBANG`, or
            ``#!lua flags=...`` for a file with a ``-- @flags`` line), then the file with its
            includes resolved.
        sha1: the hex SHA1 Redis knows the script by.
        writes: whether the script may write: every script but those flagged
            ``-- @flags no-writes`` (``inspect`` and the other readers), the one copy of that fact,
            which Redis also enforces. With ``wait_replicas`` set, a call of a writing script
            is followed by ``WAIT`` (docs/topology.md#failover).
    """

    name: str
    numkeys: int
    source: str
    sha1: str
    writes: bool = True

    def check_key_count(self, keys: Sequence[str]) -> None:
        """Refuse a call with another number of keys than the script declares, before
        anything is sent. Raises ``ValueError`` (``"claim takes 4 keys, got 3"``)."""
        if len(keys) != self.numkeys:
            raise ValueError(f"{self.name} takes {self.numkeys} keys, got {len(keys)}")


def _lua_dir() -> Path:
    packaged = resources.files("claimkit") / "lua"
    if packaged.is_dir():
        return Path(str(packaged))
    # Running from a source checkout without an install: the repository's top-level lua/.
    source = Path(__file__).resolve().parents[2] / "lua"
    if source.is_dir():
        return source
    raise ScriptError("claimkit's Lua scripts are missing: neither claimkit/lua nor ./lua exists")


def _resolve(text: str, folder: Path, pasted: set[str], seen: tuple[str, ...] = ()) -> str:
    """``text`` with each ``-- @include _name`` replaced by that file, itself resolved.

    An include is pasted once per script, where it is first named (an include may name the
    includes it uses, and a script may name them too): ``pasted`` holds the names already in.
    """

    def paste(match: re.Match[str]) -> str:
        name = match.group("name")
        if name in seen:
            raise ScriptError(f"include cycle through {name}.lua")
        if name in pasted:
            return ""
        path = folder / f"{name}.lua"
        if not path.is_file():
            raise ScriptError(f"included file {path} does not exist")
        pasted.add(name)
        return _resolve(path.read_text(encoding="utf-8"), folder, pasted, (*seen, name))

    return _INCLUDE.sub(paste, text)


def _flags(name: str, text: str) -> tuple[str, ...]:
    """The Redis script flags the file ``text`` names on its ``-- @flags`` line (at most
    one such line, Redis's flag names only); none when it has no such line."""
    found = _FLAGS.findall(text)
    if not found:
        return ()
    if len(found) > 1:
        raise ScriptError(f"{name}: more than one -- @flags line")
    flags = tuple(found[0].split(","))
    unknown = sorted(set(flags) - _KNOWN_FLAGS)
    if unknown:
        raise ScriptError(f"{name}: unknown script flag {unknown[0]!r}")
    return flags


def _shebang(flags: tuple[str, ...]) -> str:
    """The shebang line of a script with ``flags``: :data:`SHEBANG`, or ``#!lua flags=...``."""
    return f"#!lua flags={','.join(flags)}\n" if flags else SHEBANG


@cache
def all_scripts() -> dict[str, Script]:
    """Every script by verb. Raises :class:`ScriptError` when the folder is broken."""
    folder = _lua_dir()
    found: dict[str, Script] = {}
    for path in sorted(folder.glob("*.lua")):
        if path.name.startswith("_"):
            continue
        match = _NAME.match(path.name)
        if match is None:
            raise ScriptError(f"{path.name}: a script is named <verb>-<numkeys>.lua")
        text = path.read_text(encoding="utf-8")
        flags = _flags(path.name, text)
        source = _shebang(flags) + _resolve(text, folder, set())
        sha1 = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()
        verb = match.group("verb")
        writes = "no-writes" not in flags
        found[verb] = Script(verb, int(match.group("numkeys")), source, sha1, writes)
    return found


def script(name: str) -> Script:
    """The script called ``name`` (e.g. ``"claim"``). Raises ``KeyError`` if there is none."""
    return all_scripts()[name]
