"""The consumer runtime behind ``claimkit serve``: wiring and shutdown, claim state, the
poll, settle and upkeep loops, dispatch, the gateway client, gates, metrics and health
(docs/architecture.md)."""
