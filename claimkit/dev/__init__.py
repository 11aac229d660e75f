"""Development tools: the durability demo, the gateway simulator and private Redis servers
for tests (docs/demo.md, docs/redis-server.md). Nothing at runtime imports this package.

What only these tools need (httpx, for the demo) is the ``dev`` extra: ``pip install
'.[dev]'`` from a checkout; ``nox -s demo`` and ``nox -s tests`` install it. A tool run
without it raises :class:`DevExtraMissing` on import, which ``claimkit`` prints as one line.
"""

from __future__ import annotations

__all__ = ["DevExtraMissing"]


class DevExtraMissing(ImportError):
    """A development tool needs a package of the ``dev`` extra that is not installed.

    ``str(err)`` is one line: the tool, the missing module and what to install.
    """

    def __init__(self, tool: str, module: str | None) -> None:
        super().__init__(
            f"{tool} needs the dev extra (no module {module!r}): "
            "pip install 'claimkit[dev]' (from a checkout: pip install '.[dev]')",
            name=module,
        )
