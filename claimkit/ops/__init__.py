"""Operator tools over the protocol layer: inspect, drain, dead letters, ACL rules
(docs/operations.md, docs/architecture.md). No terminal output here: the CLI renders."""
