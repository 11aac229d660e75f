"""The ``claimkit`` command line: thin typer commands over the ops, consumer and dev layers;
the only place that renders with rich (docs/cli.md, docs/architecture.md)."""
