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
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from support import free_port

if TYPE_CHECKING:
    from collections.abc import Callable
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
    """GET ``url``; its body. A connect that the kernel answers with ``EAGAIN`` (a loaded
    machine's loopback) is tried again, up to 20 times, 0.1 s apart; any other error is
    raised (an HTTP error status as :class:`urllib.error.HTTPError`, its connection closed:
    ``/-/ready`` answers 503 while a server starts)."""
    for attempt in range(20):
        try:
            with urllib.request.urlopen(url, timeout=timeout) as answer:
                body: bytes = answer.read()
                return body
        except urllib.error.HTTPError as exc:
            exc.close()
            raise
        except urllib.error.URLError as exc:
            if not isinstance(exc.reason, BlockingIOError) or attempt == 19:
                raise
        except BlockingIOError:
            if attempt == 19:
                raise
        time.sleep(0.1)
    raise AssertionError("unreachable")


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
    """One server process on a free port of 127.0.0.1, stopped by PID.

    A port free a moment ago may be taken by another process before the server binds it
    (tests of other sessions run on this machine too): the server then exits, or another
    server answers on the port. Each start checks that the server answering is this one
    (:meth:`_ours`: the flags it reports name this folder) and tries another port if not.
    """

    ATTEMPTS = 5

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = folder / "server.log"
        self._pick_port()

    def _pick_port(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def _argv(self) -> list[str]:
        raise NotImplementedError

    def _ours(self) -> bool:
        """Whether the server answering on :attr:`port` is the one started here."""
        raise NotImplementedError

    def __enter__(self) -> _Process:
        name = Path(self._argv()[0]).name
        for _attempt in range(self.ATTEMPTS):
            with self._log.open("wb") as log:
                self._proc = subprocess.Popen(
                    self._argv(), cwd=self.folder, stdout=log, stderr=subprocess.STDOUT
                )
            if poll_until(f"{name} to start", self._started, timeout=60) == "ready":
                return self
            self._stop()
            self._pick_port()
        raise AssertionError(f"{name} found no free port in {self.ATTEMPTS} attempts")

    def _started(self) -> str:
        """``"ready"`` once this server answers, ``"lost"`` when it exited or another
        answers on its port; an error while nothing answers yet (:func:`poll_until`
        tries again)."""
        assert self._proc is not None
        if self._proc.poll() is not None:
            return "lost"
        fetch(self.url + "/-/ready")
        return "ready" if self._ours() else "lost"

    def _stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop()


class Pushgateway(_Process):
    """``prometheus-pushgateway`` on a free port. Debian's build persists pushes to
    ``/var/lib/prometheus/pushgateway.data`` by default: here they go to a file in the
    temporary folder, so no push outlives the test or leaks into another."""

    def _argv(self) -> list[str]:
        return [
            binary("prometheus-pushgateway"),
            f"--web.listen-address=127.0.0.1:{self.port}",
            f"--persistence.file={self.folder / 'pushgateway.data'}",
        ]

    def _ours(self) -> bool:
        flags = json.loads(fetch(self.url + "/api/v1/status"))["data"]["flags"]
        return bool(flags["persistence.file"] == str(self.folder / "pushgateway.data"))

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

    def _ours(self) -> bool:
        flags = json.loads(fetch(self.url + "/api/v1/status/flags"))["data"]
        return bool(flags["config.file"] == str(self.folder / "prometheus.yml"))

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
