"""Masking the passwords of Redis URLs, in a URL or in a message (docs/security.md)."""

from __future__ import annotations

import re

__all__ = ["redact_url"]

# In a message, outside quotes: scheme://user:password@ where the password runs to the
# last '@' before a space, a quote or a '/' (so "redis://host:6379/0 ... user@x" keeps its
# port and its text). A URL in quotes (``{url!r}``) is masked as a whole URL.
_PASSWORD = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s'\"]*:)([^\s'\"/]*)(@)")
_QUOTED_URL = re.compile(r"""(['"])([a-zA-Z][a-zA-Z0-9+.-]*://[^\n]*?)\1""")
# ?password=... (or &password=...), which redis URLs accept as well.
_QUERY_PASSWORD = re.compile(r"([?&](?:password|pass|pwd)=)([^&#\s'\"]*)", re.IGNORECASE)
_WHOLE_QUERY_PASSWORD = re.compile(r"([?&](?:password|pass|pwd)=)([^&#]*)", re.IGNORECASE)
_SCHEME = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://")


def redact_url(text: str) -> str:
    """Mask every password of a Redis URL in ``text``: ``redis://user:secret@host`` ->
    ``redis://user:***@host`` and ``?password=secret`` -> ``?password=***``.

    ``text`` is either one URL (it starts with ``scheme://``; then a password may hold any
    character, spaces included) or a message with URLs in it. In a message a quoted URL is
    masked as a whole URL; elsewhere a password ends at the last ``@`` before a space, a
    quote or a ``/``. claimkit quotes the URLs it puts in messages, or masks them first.
    """
    if _SCHEME.match(text) and "\n" not in text:
        return _redact_whole(text)
    text = _QUOTED_URL.sub(lambda m: m.group(1) + _redact_whole(m.group(2)) + m.group(1), text)
    return _QUERY_PASSWORD.sub(r"\1***", _PASSWORD.sub(r"\1***\3", text))


def _redact_whole(url: str) -> str:
    return _WHOLE_QUERY_PASSWORD.sub(r"\1***", _mask_userinfo(url))


def _mask_userinfo(url: str) -> str:
    scheme, _, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.partition(":")[0]
    return f"{scheme}://{user}:***@{host}"
