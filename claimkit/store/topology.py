"""Which Redis topology a store connects to: :class:`Topology` (docs/topology.md).

``url`` stays the store's first address in every mode (and carries the credentials, TLS
settings and database); a topology adds the mode and, for a cluster or sentinel, more
addresses: seed nodes of a cluster, or sentinels.
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from claimkit._errors import ConfigError

__all__ = ["MODES", "Topology", "parse_addr"]

MODES = ("standalone", "cluster", "sentinel")
"""The three values of ``mode``, standalone first (the default)."""


def parse_addr(addr: str) -> tuple[str, int]:
    """``"host:port"`` as ``(host, port)``; an IPv6 host goes in brackets
    (``"[::1]:7000"``, returned as ``("::1", 7000)``). Exactly that: no scheme, no spaces,
    one ``:`` outside the brackets, a port in 1-65535.

    Raises:
        ConfigError: one line naming the entry and its fault
            (docs/topology.md#configuration), e.g. ``addrs entry "h:99999" has port 99999,
            out of range 1-65535``.
    """
    shown = json.dumps(addr, ensure_ascii=False)

    def bad(why: str) -> ConfigError:
        return ConfigError(f"addrs entry {shown} {why}")

    if "://" in addr:
        raise bad('must be "host:port" without a scheme')
    if any(c.isspace() for c in addr):
        raise bad('must be "host:port" without spaces')
    if addr.startswith("["):
        host, sep, port = addr[1:].partition("]:")
        if not sep or "]" in port or not _is_ipv6(host):
            raise bad('must be "[IPv6 address]:port"')
    else:
        host, sep, port = addr.partition(":")
        if ":" in port:
            raise bad('must be "host:port" with one ":" (an IPv6 host in brackets: "[::1]:7000")')
        if not sep:
            raise bad('must be "host:port"')
        if not host:
            raise bad('must be "host:port" (no host)')
        if not _HOST.fullmatch(host):
            raise bad(f'must be "host:port" (bad host {json.dumps(host, ensure_ascii=False)})')
    if not port:
        raise bad('must be "host:port" (no port)')
    if not (port.isascii() and port.isdigit()):
        raise bad(
            f'must be "host:port" (port {json.dumps(port, ensure_ascii=False)} is not a number)'
        )
    if not 0 < int(port) < 65536:
        raise bad(f"has port {int(port)}, out of range 1-65535")
    return host, int(port)


_HOST = re.compile(r"[A-Za-z0-9_.-]+")
"""A host name or IPv4 address (letters, digits, ``.``, ``-``, ``_``)."""


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class Topology:
    """The topology fields of the transport config (docs/topology.md#configuration).

    Attributes:
        mode: ``"standalone"`` (default), ``"cluster"`` or ``"sentinel"``.
        addrs: more ``"host:port"`` addresses: cluster seed nodes, or sentinels; the URL's
            host and port come first.
        master_name: the name the sentinels monitor the primary under (sentinel only).
    """

    mode: str = "standalone"
    addrs: tuple[str, ...] = ()
    master_name: str | None = None

    def validate(self, url: str | None = None) -> None:
        """Check the fields together (and, given ``url``, its database for a cluster).

        Raises:
            ConfigError: one line, in llm-d-async's words (docs/topology.md#configuration):
                ``unknown mode "x" (expected "standalone", "cluster" or "sentinel")``,
                ``addrs requires mode "cluster" or "sentinel"``,
                ``master_name requires mode "sentinel"``,
                ``master_name is required when mode is "sentinel"``,
                ``mode "cluster" does not support selecting database N; use database 0 in
                url``, ``mode "cluster" needs a TCP url (redis:// or rediss://), not
                unix://`` (``"sentinel"`` too: a cluster's nodes and the sentinels are TCP
                addresses), or an ``addrs entry "x" ...`` line of :func:`parse_addr`.
        """
        if self.mode not in MODES:
            raise ConfigError(
                f'unknown mode "{self.mode}" (expected "standalone", "cluster" or "sentinel")'
            )
        if self.addrs and self.mode == "standalone":
            raise ConfigError('addrs requires mode "cluster" or "sentinel"')
        if self.master_name and self.mode != "sentinel":
            raise ConfigError('master_name requires mode "sentinel"')
        if self.mode == "sentinel" and not self.master_name:
            raise ConfigError('master_name is required when mode is "sentinel"')
        for addr in self.addrs:
            parse_addr(addr)
        if self.mode != "standalone" and url is not None and urlsplit(url).scheme == "unix":
            raise _needs_tcp(self.mode)
        if self.mode == "cluster" and url is not None:
            db = url_database(url)
            if db != 0:
                raise ConfigError(
                    f'mode "cluster" does not support selecting database {db}; '
                    "use database 0 in url"
                )

    def seeds(self, url: str) -> list[tuple[str, int]]:
        """The URL's host and port, then :attr:`addrs`, without repeats: a cluster's seed
        nodes or the sentinels, in the order they are tried."""
        parts = urlsplit(url)
        if parts.scheme == "unix" or not parts.hostname:
            raise _needs_tcp(self.mode)  # never a made-up 127.0.0.1:6379 in its place
        out = [(parts.hostname, parts.port or 6379)]
        for addr in self.addrs:
            seed = parse_addr(addr)
            if seed not in out:
                out.append(seed)
        return out


def _needs_tcp(mode: str) -> ConfigError:
    return ConfigError(f'mode "{mode}" needs a TCP url (redis:// or rediss://), not unix://')


def url_database(url: str) -> int:
    """The database a Redis URL selects, read as coredis and redis-py read it: its ``db``
    query parameter (the first one), else its path (``/3``; not for ``unix://``, whose path
    is the socket), else 0. A malformed number counts as 0 here (``check_url`` refuses it)."""
    parts = urlsplit(url)
    for name, values in parse_qs(parts.query).items():
        if name.lower() == "db" and values[0].strip().isdigit():
            return int(values[0])
    path = parts.path.replace("/", "")
    if parts.scheme != "unix" and path.isdigit():
        return int(path)
    return 0
