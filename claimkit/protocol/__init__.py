"""The protocol layer: key names and types, member and record formats, and
:class:`~claimkit.protocol.ops.QueueOps`, the only caller of the Lua scripts
(docs/architecture.md, docs/protocol.md)."""
