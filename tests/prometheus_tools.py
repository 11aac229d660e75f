"""Test support: Debian's Prometheus binaries (``promtool``, ``prometheus``,
``prometheus-pushgateway``) as private processes.

:func:`binary` finds one; where it is missing the test is skipped with the reason, except
under CI (``CI`` set in the environment), where it fails: ``.ci/run`` installs Debian's
``prometheus`` and ``prometheus-pushgateway`` packages, so a missing binary there is a broken
setup, not a machine without them. :class:`Pushgateway` and :class:`Prometheus` start one
process each on a free port of 127.0.0.1 in a temporary folder, wait until it answers, and
stop it by its PID.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from typing import TYPE_CHECKING, Any

import pytest
from support import free_port

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path
    from types import TracebackType

__all__ = ["Prometheus", "Pushgateway", "binary", "fetch", "poll_until"]

DEBIAN_PACKAGES = {
    "promtool": "prometheus",
    "prometheus": "prometheus",
    "prometheus-pushgateway": "prometheus-pushgateway",
}


def binary(name: str) -> str:
    """The path of ``name`` (``/usr/bin`` first, then ``PATH``); skip the test when it is
    missing, fail under CI."""
    for candidate in (f"/usr/bin/{name}", shutil.which(name)):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    why = f"{name} is not installed (Debian package {DEBIAN_PACKAGES.get(name, name)})"
    if os.environ.get("CI"):
        pytest.fail(f"{why}, and CI is set: .ci/run installs it")
    pytest.skip(why)


def fetch(url: str, timeout: float = 5.0) -> bytes:
    """GET ``url``; its body."""
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        body: bytes = answer.read()
        return body


def poll_until(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Call ``check`` every 0.1 s until it returns something true (an error counts as not
    yet); that value. AssertionError naming ``what`` after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < end:
        try:
            value = check()
        except (OSError, ValueError, KeyError) as exc:
            last = exc
        else:
            if value:
                return value
            last = value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


class _Process:
    """One server process on a free port of 127.0.0.1, stopped by PID."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = folder / "server.log"

    def _argv(self) -> list[str]:
        raise NotImplementedError

    def __enter__(self) -> _Process:
        with self._log.open("wb") as log:
            self._proc = subprocess.Popen(
                self._argv(), cwd=self.folder, stdout=log, stderr=subprocess.STDOUT
            )
        poll_until(f"{self._argv()[0]} to be ready", self._ready, timeout=60)
        return self

    def _ready(self) -> bool:
        assert self._proc is not None
        if self._proc.poll() is not None:
            raise AssertionError(f"{self._argv()[0]} exited: {self._log.read_text()}")
        return fetch(self.url + "/-/ready") is not None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


class Pushgateway(_Process):
    """``prometheus-pushgateway`` on a free port, nothing persisted."""

    def _argv(self) -> list[str]:
        return [binary("prometheus-pushgateway"), f"--web.listen-address=127.0.0.1:{self.port}"]

    def __enter__(self) -> Pushgateway:
        super().__enter__()
        return self


class Prometheus(_Process):
    """``prometheus`` on a free port, scraping ``targets`` (``host:port``, ``/metrics``)
    every second, its data in the temporary folder."""

    def __init__(self, folder: Path, targets: list[str], *, honor_labels: bool = False) -> None:
        super().__init__(folder)
        job: dict[str, Any] = {
            "job_name": "claimkit",
            "scrape_interval": "1s",
            "static_configs": [{"targets": targets}],
        }
        if honor_labels:  # a Pushgateway's job/instance labels are kept (its usual setting)
            job["honor_labels"] = True
        config = {"global": {"scrape_interval": "1s"}, "scrape_configs": [job]}
        (folder / "prometheus.yml").write_text(json.dumps(config))

    def _argv(self) -> list[str]:
        return [
            binary("prometheus"),
            f"--config.file={self.folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={self.folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]

    def __enter__(self) -> Prometheus:
        super().__enter__()
        return self

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector of ``expr`` now (``/api/v1/query``): ``[{"metric": {...},
        "value": [time, "text"]}, ...]``."""
        url = self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        doc = json.loads(fetch(url))
        assert doc["status"] == "success", doc
        result: list[dict[str, Any]] = doc["data"]["result"]
        return result

    def values(self, expr: str) -> dict[str, float]:
        """``expr``'s series now by their ``queue_name`` label: their values."""
        return {r["metric"].get("queue_name", ""): float(r["value"][1]) for r in self.query(expr)}
