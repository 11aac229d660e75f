"""Small helpers shared by the benchmarks under ``bench/``."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import subprocess
from pathlib import Path

# The peers harness: ../shared/peers beside the checkout, unless CLAIMKIT_PEERS_DIR says.
PEERS_DIR = Path(
    os.environ.get(
        "CLAIMKIT_PEERS_DIR", Path(__file__).resolve().parent.parent.parent / "shared" / "peers"
    )
)
"""The peers harness (read-only); its ``gateway.js`` and ``runners/common.py`` are used."""


def free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        if port not in (6379, 6390):
            return port


def pin_self(core: int) -> None:
    """Pin this process to one core, as the peers harness pins its workers (best effort)."""
    try:
        os.sched_setaffinity(0, {core})
    except (AttributeError, OSError):
        pass


def machine() -> dict[str, object]:
    """What the figures were measured on."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for dist in ("claimkit", "trio", "coredis", "redis", "httpx", "httpcore", "h11", "msgspec"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    try:
        redis_v = subprocess.run(
            ["redis-server", "--version"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        redis_v = None
    try:
        node_v = subprocess.run(
            ["node", "--version"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        node_v = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "redis": redis_v,
        "node": node_v,
        "versions": versions,
    }
