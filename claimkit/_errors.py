"""Errors every layer may raise, defined below all of them (it imports nothing of claimkit).

:class:`ConfigError` is raised by the config layer (a bad field) and by the store layer (a
store backend that cannot be used here), so it cannot live in either one without an upward
import. ``claimkit.config`` and ``claimkit`` re-export it: import it from there.
"""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """The configuration is unusable; ``str(err)`` is one line naming the field."""


ConfigError.__module__ = "claimkit.config"
