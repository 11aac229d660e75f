"""The single entry point: `nox -s tests` (what CI runs), `demo`, `lint`, `typecheck`, `bench`."""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True

PYTHON = os.environ.get("CLAIMKIT_PYTHON", "python3")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The whole test suite against real redis-server processes (installed wheel).

    The optional redis-py + trio-asyncio backend is installed too, so its tests run (they
    skip themselves on Python >= 3.14, where trio-asyncio does not import)."""
    session.install(".[test,redispy]")
    session.run("pytest", *(session.posargs or ["-q"]))


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The durability demo: private Redis, simulator, two consumers, one SIGKILLed."""
    session.install(".")
    session.run("claimkit", "demo", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install("ruff==0.17.6")  # pinned: a new rule must not fail CI unannounced
    session.run("ruff", "check", "claimkit", "tests", "bench", "noxfile.py")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    session.install(".[test]", "mypy==2.4.1")
    session.run("mypy", "claimkit")


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmarks under bench/ (figures go into docs/performance.md)."""
    session.install(".")
    session.run("python", "bench/protocol.py", *session.posargs)
