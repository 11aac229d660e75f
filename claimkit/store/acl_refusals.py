"""ACL refusals (``NOPERM``) turned into one line naming the user, the command and the key
(:class:`~claimkit.store.interface.StorePermissionError`; docs/security.md)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from claimkit.store.interface import Arg, StorePermissionError, reply_text

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

__all__ = [
    "ACL_LOG_ENTRIES",
    "acl_user",
    "command_keys",
    "is_acl_refusal",
    "permission_error",
]

# Redis 7.0 says "NOPERM this user has no permissions to run the 'x' command" / "... to
# access one of the keys used as arguments"; 7.2+ "NOPERM User u has no permissions to run
# the 'x' command" / "NOPERM No permissions to access a key". Inside a script 7.0 says
# "ERR The user executing the script can't run this command ..." and 7.2+ "ERR ACL failure
# in script: ...".
_ACL_MARKS = (
    "NOPERM",
    "The user executing the script can't",
    "ACL failure in script",
)
_REFUSED_COMMAND = re.compile(r"permissions to run the '([^']+)' command")
_IN_SCRIPT = ("The user executing the script can't", "ACL failure in script")
_SCRIPT_COMMAND = ("can't run this command", "permissions to run")
_SCRIPT_LINE = re.compile(r"@user_script:(\d+)")
_NO_KEYS = frozenset(
    {"TIME", "MULTI", "EXEC", "DISCARD", "PING", "INFO", "ACL", "SCRIPT", "CLIENT", "CONFIG"}
)
_ALL_KEYS = frozenset({"DEL", "UNLINK", "EXISTS", "MGET", "TOUCH", "WATCH"})
_TWO_KEYS = frozenset({"BLMOVE", "LMOVE", "RPOPLPUSH", "BRPOPLPUSH", "SMOVE", "RENAME"})
ACL_LOG_ENTRIES = 32
"""How many of Redis's newest ``ACL LOG`` entries a refusal is looked up in."""


def is_acl_refusal(message: str) -> bool:
    """Whether a Redis error text is an ACL refusal (a command, a key or a channel)."""
    return any(mark in message for mark in _ACL_MARKS)


def command_keys(args: Sequence[Arg]) -> list[str]:
    """The key arguments of a command claimkit sends (``EVALSHA sha 2 k1 k2 ...`` ->
    ``[k1, k2]``; ``ZADD q ...`` -> ``[q]``; ``TIME`` -> ``[]``)."""
    if not args:
        return []
    name = str(args[0]).upper()
    rest = [reply_text(a) for a in args[1:]]
    if name in ("EVAL", "EVALSHA", "EVAL_RO", "EVALSHA_RO"):
        try:
            return rest[2 : 2 + int(rest[1])]
        except (IndexError, ValueError):
            return []
    if name in _NO_KEYS:
        return []
    if name in _ALL_KEYS:
        return rest
    if name in _TWO_KEYS:
        return rest[:2]
    return rest[:1]


def acl_user(url: str) -> str:
    """The ACL user a Redis URL authenticates as (``"default"`` when it names none)."""
    try:
        return unquote(urlsplit(url).username or "") or "default"
    except ValueError:
        return "default"


def _entries(reply: Any) -> list[dict[str, str]]:
    """``ACL LOG`` entries as ``{field: text}`` (RESP3 maps or RESP2 flat lists)."""
    out: list[dict[str, str]] = []
    for entry in reply if isinstance(reply, list) else ():
        if isinstance(entry, dict):
            pairs = list(entry.items())
        elif isinstance(entry, list):
            pairs = list(zip(entry[::2], entry[1::2], strict=False))
        else:
            continue
        out.append({reply_text(k): reply_text(v) for k, v in pairs})
    return out


async def permission_error(
    message: str,
    commands: Sequence[Sequence[Arg]],
    *,
    user: str,
    acl_log: Callable[[], Awaitable[Any]],
    written: bool = True,
    script_name: str | None = None,
) -> StorePermissionError:
    """Turn Redis's ACL refusal ``message`` of one of ``commands`` into one precise line.

    A refused command is named by Redis itself. A refused key is not: it is looked up in
    ``ACL LOG`` (``acl_log`` runs ``ACL LOG <n>``): the newest entry of ``user`` whose key
    is one of the keys ``commands`` sent. When that lookup is refused too (a narrow user
    seldom may run ``ACL LOG``) the line names the command and the keys it sent.

    Args:
        message: Redis's error text.
        commands: what was sent (each ``(name, *args)``); the refused one first, when known.
        user: the connection's ACL user.
        acl_log: runs ``ACL LOG``; any error it raises is taken as "cannot look it up".
        written: whether the call may have written anything.
        script_name: the claimkit script the commands ran, for the line.
    """
    first = str(commands[0][0]).upper() if commands else "?"
    in_script = any(mark in message for mark in _IN_SCRIPT)
    where = _script_place(message, script_name) if in_script else ""
    command, key = first, None
    refused = _REFUSED_COMMAND.search(message)
    keys = list(dict.fromkeys(k for c in commands for k in command_keys(c)))
    if refused is not None:
        command = refused.group(1).upper()
        via = f" (sent as {first}{where})" if command != first else where
        line = f"user {user!r} may not run {command}{via}: grant +{refused.group(1).lower()}"
    else:
        entry = await _log_entry(acl_log, user, keys, in_script)
        if entry is not None and entry.get("reason") == "command":
            command = entry.get("object", "?").upper()
            line = (
                f"user {user!r} may not run {command}{where or ' in a script'}: "
                f"grant +{command.lower()}"
            )
        elif in_script and any(mark in message for mark in _SCRIPT_COMMAND):
            line = (
                f"user {user!r} may not run a command{where or ' in a script'} (ACL LOG, "
                "which names it, is refused too): grant it"
            )
        elif entry is not None or len(keys) == 1:
            key = entry["object"] if entry is not None else keys[0]
            line = f"user {user!r} may not access key {key!r} with {first}{where}"
            line += ": grant a ~pattern matching it"
        else:
            shown = ", ".join(map(repr, keys)) or "none"
            line = (
                f"user {user!r} may not access one of the keys of {first}{where} ({shown}; "
                "ACL LOG, which names it, is refused too): grant ~patterns matching them"
            )
    line += f" (Redis: {message.strip()})"
    if not written:
        line += "; nothing was written"
    line += "; `claimkit acl` prints the rule claimkit needs (docs/security.md)"
    return StorePermissionError(line, user=user, command=command, key=key, written=written)


def _script_place(message: str, script_name: str | None) -> str:
    """`` in script 'claim' (line 54: redis.call(...))`` from a script error's line number."""
    if not script_name:
        return ""
    place = f" in script {script_name!r}"
    found = _SCRIPT_LINE.search(message)
    if found is None:
        return place
    from claimkit.store.scripts import script

    try:
        lines = script(script_name).source.splitlines()
        text = lines[int(found.group(1)) - 1].strip()
    except (KeyError, IndexError, ValueError):
        return place
    return f"{place} (line {found.group(1)}: {text})"


async def _log_entry(
    acl_log: Callable[[], Awaitable[Any]], user: str, keys: list[str], in_script: bool
) -> dict[str, str] | None:
    """The newest ``ACL LOG`` entry of ``user`` that names one of ``keys`` (or, for a
    refusal inside a script, a command refused there); ``None`` when there is none or the
    log cannot be read (a narrow user seldom may run ``ACL LOG``)."""
    try:
        log = _entries(await acl_log())
    except Exception:
        return None
    for entry in log:
        if entry.get("username") != user:
            continue
        if entry.get("reason") == "key" and entry.get("object") in keys:
            return entry
        if in_script and entry.get("reason") == "command" and entry.get("context") == "lua":
            return entry
    return None
