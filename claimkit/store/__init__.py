"""The store layer: one Redis (a standalone server, a cluster or a sentinel-managed primary)
behind the :class:`Store` protocol.

- :mod:`~claimkit.store.interface`: the :class:`Store` protocol, ``Arg``, ``ScriptCall`` and
  the errors (:class:`StoreUnavailable`, :class:`StoreError` and its two kinds);
- :mod:`~claimkit.store.connect`: :func:`open_store`; :mod:`~claimkit.store.topology`:
  :class:`Topology` (``mode``, ``addrs``, ``master_name``; docs/topology.md);
- :mod:`~claimkit.store.urls`, :mod:`~claimkit.store.redact`, :mod:`~claimkit.store.tls`: the
  URL checked before connecting, its passwords masked, TLS defaults and certificate problems;
- :mod:`~claimkit.store.acl_refusals`: an ACL refusal turned into one precise line;
- :mod:`~claimkit.store.coredis_store`, :mod:`~claimkit.store.redispy_store`: the backends,
  sharing :mod:`~claimkit.store.script_calls` (with the ``wait_replicas`` ``WAIT``);
  :mod:`~claimkit.store.cluster_store` and :mod:`~claimkit.store.sentinel_store`: coredis on
  a Redis Cluster and on a Sentinel-managed primary; :mod:`~claimkit.store.slots`: keys and
  hash slots;
- :mod:`~claimkit.store.server_checks`: the mode-mismatch refusals and the eviction check;
- :mod:`~claimkit.store.scripts`: the Lua script loader.

Imports nothing else of claimkit but ``claimkit._errors`` (docs/store-backends.md). Other
layers import the names below from ``claimkit.store``.
"""

from __future__ import annotations

from claimkit.store.connect import open_store as open_store
from claimkit.store.interface import Arg as Arg
from claimkit.store.interface import ScriptCall as ScriptCall
from claimkit.store.interface import Store as Store
from claimkit.store.interface import StoreError as StoreError
from claimkit.store.interface import StorePermissionError as StorePermissionError
from claimkit.store.interface import StoreTlsError as StoreTlsError
from claimkit.store.interface import StoreUnavailable as StoreUnavailable
from claimkit.store.interface import reply_text as reply_text
from claimkit.store.redact import redact_url as redact_url
from claimkit.store.tls import CLIENT_CERT_HINT as CLIENT_CERT_HINT
from claimkit.store.topology import Topology as Topology
from claimkit.store.urls import check_url as check_url

__all__ = [
    "CLIENT_CERT_HINT",
    "Arg",
    "ScriptCall",
    "Store",
    "StoreError",
    "StorePermissionError",
    "StoreTlsError",
    "StoreUnavailable",
    "Topology",
    "check_url",
    "open_store",
    "redact_url",
    "reply_text",
]
