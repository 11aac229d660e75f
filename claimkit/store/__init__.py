"""The store layer: one Redis connection behind the :class:`~claimkit.store.api.Store` protocol.

URL and TLS checks, the coredis and redis-py backends, server checks and the Lua script
loader. Imports nothing else of claimkit (docs/architecture.md)."""
