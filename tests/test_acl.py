"""A password- and ACL-protected Redis: `claimkit acl`'s rules are enough and exact, a refusal
names the user, the command and the key, and a refused transaction writes nothing."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
from support import free_port, mask_noperm, redis, snapshot, wait_port
from typer.testing import CliRunner

from claimkit.cli.app import app
from claimkit.config import load_config
from claimkit.dev.redis_server import RedisServer
from claimkit.ops.acl import acl_rule
from claimkit.producer import Producer
from claimkit.protocol.models import Envelope, parse_member
from claimkit.protocol.ops import QueueOps
from claimkit.store import Store, StorePermissionError, open_store

pytestmark = pytest.mark.slow

RedisFactory = Callable[..., RedisServer]
CLAIMKIT = str(Path(sys.executable).with_name("claimkit"))
Q = "requests"
ADMIN_PASSWORD = "admin pw"
NO_HTTP = ("--metrics-port", "0", "--health-port", "0")


@dataclass
class AclRedis:
    port: int

    def url(self, user: str, password: str) -> str:
        return f"redis://{user}:{password.replace(' ', '%20')}@127.0.0.1:{self.port}/0"

    @property
    def admin(self) -> str:
        return self.url("default", ADMIN_PASSWORD)

    def setuser(self, user: str, rule: str) -> None:
        """(Re)define ``user`` with password ``pw-<user>`` and exactly ``rule``."""
        redis(self.admin, lambda s: s.command("ACL", "SETUSER", user, "reset"))
        redis(
            self.admin,
            lambda s: s.command("ACL", "SETUSER", user, "on", f">pw-{user}", *rule.split()),
        )

    def user_url(self, user: str) -> str:
        return self.url(user, f"pw-{user}")


@pytest.fixture
def acl_redis(redis_factory: RedisFactory) -> AclRedis:
    """A private Redis whose default user needs a password, for ACL users of the test's own."""
    server = redis_factory()
    redis(server.url, lambda s: s.command("ACL", "SETUSER", "default", "on", f">{ADMIN_PASSWORD}"))
    return AclRedis(server.port)


def config(gateway: str = "http://127.0.0.1:9") -> dict[str, Any]:
    return {
        "poll_interval_ms": 50,
        "claim_reclaim_interval_ms": 200,
        "drain_timeout_seconds": 1,
        "queues": [
            {
                "queue_name": Q,
                "igw_base_url": gateway,
                "gate_type": "redis",
                "gate_params": {"key": "budget:requests"},
            }
        ],
    }


def rules_for(conf: dict[str, Any]) -> dict[str, str]:
    """``claimkit acl --rule-only`` per role, from the CLI itself."""
    out = {}
    for role in ("consumer", "producer", "operator"):
        result = CliRunner().invoke(
            app, ["acl", "--role", role, "--rule-only", "--transport-config", json.dumps(conf)]
        )
        assert result.exit_code == 0, result.output
        out[role] = result.stdout.strip()
    return out


def cli(
    url: str, *args: str, conf: dict[str, Any] | None = None
) -> subprocess.CompletedProcess[str]:
    """A claimkit command as a process, its URL in $REDIS_URL (not on the command line)."""
    extra = ["--transport-config", json.dumps(conf)] if conf is not None else []
    return subprocess.run(
        [CLAIMKIT, *args, *extra],
        env={**os.environ, "REDIS_URL": url},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def sims(tmp_path: Path) -> Iterator[Callable[..., str]]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> str:
        port = free_port()
        with (tmp_path / f"sim-{port}.log").open("w") as log:
            procs.append(
                subprocess.Popen(
                    [CLAIMKIT, "sim", "--port", str(port), *args], stdout=log, stderr=log
                )
            )
        wait_port(port)
        return f"http://127.0.0.1:{port}"

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(10)


def serve(url: str, conf: dict[str, Any], log: Path) -> subprocess.Popen[bytes]:
    with log.open("w") as err:
        return subprocess.Popen(
            [CLAIMKIT, "serve", "--transport-config", json.dumps(conf), *NO_HTTP],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, "REDIS_URL": url},
        )


def wait_until(url: str, command: tuple[Any, ...], want: Any, proc: Any = None) -> None:
    async def poll(store: Store) -> None:
        while await store.command(*command) != want:
            assert proc is None or proc.poll() is None, "serve exited"
            await trio.sleep(0.05)

    redis(url, poll, timeout=60)


def submit(url: str, *ids: str) -> subprocess.CompletedProcess[str]:
    lines = "".join(
        json.dumps({"id": rid, "deadline": int(time.time()) + 600, "payload": {}}) + "\n"
        for rid in ids
    )
    return subprocess.run(
        [CLAIMKIT, "submit", "-q", Q],
        input=lines,
        env={**os.environ, "REDIS_URL": url},
        capture_output=True,
        text=True,
        timeout=60,
    )


def stop(proc: subprocess.Popen[bytes], log: Path) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, log.read_text()


def test_the_printed_rules_are_enough_for_every_command(
    acl_redis: AclRedis, sims: Callable[..., str], tmp_path: Path
) -> None:
    hang = sims("--rate-hang", "1")
    fast = sims()
    # The operator rule is checked against the config serve runs with; the gateway does not
    # change any key, so one rule serves both phases.
    rules = rules_for(config(hang))
    assert rules == rules_for(config(fast))
    for role, rule in rules.items():
        acl_redis.setuser(f"claimkit-{role}", rule)
    producer = acl_redis.user_url("claimkit-producer")
    consumer = acl_redis.user_url("claimkit-consumer")
    operator = acl_redis.user_url("claimkit-operator")

    done = submit(producer, "r1", "r2", "r3")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.split()) == 3

    # Phase 1: the gateway never answers, so serve holds all three claims (the lease of
    # 300 s is renewed only after 30 s: nothing changes them while drain runs).
    log = tmp_path / "serve-1.log"
    proc = serve(consumer, config(hang), log)
    wait_until(acl_redis.admin, ("HLEN", f"{Q}:claim-owners"), 3, proc)
    shown = cli(operator, "inspect", "-q", Q, "--json", conf=config(hang))
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["counts"]["claimed"] == 3
    # Paused first (the consumer reads the pause key with every peek), then drained.
    paused = cli(operator, "pause", "-q", Q, "--reason", "acl", conf=config(hang))
    assert paused.returncode == 0, paused.stderr
    assert paused.stdout.startswith(f"claimkit pause {Q}: paused since ")
    drained = cli(operator, "drain", "-q", Q, "--release-all", conf=config(hang))
    assert drained.returncode == 0, drained.stderr
    assert drained.stdout.strip().startswith(f"claimkit drain {Q}: released=3 of 3 claims")
    stop(proc, log)
    assert "NOPERM" not in log.read_text()
    resumed = cli(operator, "resume", "-q", Q, conf=config(hang))
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.startswith(f"claimkit resume {Q}: resumed; it was paused since ")
    reclaimed = cli(operator, "reclaim", "--once", conf=config(hang))
    assert reclaimed.returncode == 0, reclaimed.stderr

    # Phase 2: a gateway that answers; every request ends with one record.
    log = tmp_path / "serve-2.log"
    proc = serve(consumer, config(fast), log)
    wait_until(acl_redis.admin, ("LLEN", "result-list"), 3, proc)
    stop(proc, log)
    assert "NOPERM" not in log.read_text()

    peeked = cli(producer, "results", "--peek", "--json")
    assert peeked.returncode == 0, peeked.stderr
    assert sorted(json.loads(line)["id"] for line in peeked.stdout.splitlines()) == [
        "r1",
        "r2",
        "r3",
    ]
    for args in (
        ("dead", "list", "-q", Q),
        ("dead", "purge", "-q", Q, "--all"),
        ("dead", "requeue", "-q", Q, "--all"),
        ("results", "--count", "3"),
    ):
        ran = cli(operator, *args, conf=config(fast))
        assert ran.returncode == 0, (args, ran.stderr)
    # r1 and r2 are finished: cancel reads their keys (no NOPERM) and exits 1 by the
    # exit-status convention (docs/cli.md), naming the id.
    for who, rid in ((operator, "r1"), (producer, "r2")):
        ran = cli(who, "cancel", rid, conf=config(fast))
        assert (ran.returncode, ran.stderr) == (
            1,
            f"claimkit: no live request to cancel for '{rid}'\n",
        )


def state(url: str) -> dict[str, Any]:
    """The whole keyspace (``support.snapshot``), a string's TTL reduced to whether it
    has one: on a loaded machine a CLI process can take longer than the TTL tolerance."""
    out = redis(url, snapshot)
    for name, value in out.items():
        if isinstance(value, tuple):
            out[name] = (value[0], int(value[1]) > 0)
    return out


def without(rule: str, piece: str) -> str:
    parts = rule.split()
    assert piece in parts
    return " ".join(p for p in parts if p != piece)


def test_a_missing_key_pattern_is_named(acl_redis: AclRedis) -> None:
    rule = rules_for(config())["operator"]
    acl_redis.setuser("op", without(rule, f"~{Q}:claims-idx"))
    ran = cli(acl_redis.user_url("op"), "inspect", "-q", Q, conf=config())
    assert ran.returncode == 1
    assert mask_noperm(ran.stderr).splitlines() == [
        f"claimkit: Redis at redis://op:***@127.0.0.1:{acl_redis.port}/0 refused a command "
        f"under its ACL: user 'op' may not access key '{Q}:claims-idx' with TYPE: grant a "
        "~pattern matching it (Redis: NOPERM <server's words>); `claimkit acl` prints the "
        "rule claimkit needs "
        "(docs/security.md)"
    ]


def test_submit_without_evalsha_writes_nothing(acl_redis: AclRedis) -> None:
    rule = rules_for(config())["producer"]
    acl_redis.setuser("p", without(rule, "+evalsha"))
    before = state(acl_redis.admin)
    ran = submit(acl_redis.user_url("p"), "r1", "r2")
    assert ran.returncode == 1
    assert ran.stdout == ""
    assert mask_noperm(ran.stderr).splitlines() == [
        f"claimkit: Redis at redis://p:***@127.0.0.1:{acl_redis.port}/0 refused a command "
        "under its ACL: user 'p' may not run EVALSHA: grant +evalsha (Redis: NOPERM <server's "
        "words>); `claimkit acl` prints the rule claimkit needs (docs/security.md)"
    ]
    # The refused script call was the only write: nothing was written.
    assert state(acl_redis.admin) == before == {}


def test_drain_without_multi_releases_nothing(acl_redis: AclRedis) -> None:
    rules = rules_for(config())
    acl_redis.setuser("claimkit-producer", rules["producer"])
    acl_redis.setuser("claimkit-consumer", rules["consumer"])
    acl_redis.setuser("op", without(rules["operator"], "+multi"))
    assert submit(acl_redis.user_url("claimkit-producer"), "r1", "r2").returncode == 0

    async def claim(store: Store) -> None:
        ops = QueueOps(store, Q)
        envs = [parse_member(raw) for raw in await ops.peek(10)]
        pairs = [(e, f"token-{i}") for i, e in enumerate(envs) if isinstance(e, Envelope)]
        _, codes = await ops.claim(pairs, 300)
        assert len(codes) == 2

    redis(acl_redis.user_url("claimkit-consumer"), claim)
    before = state(acl_redis.admin)
    assert {k for k in before if not k.startswith(f"request-seq:{Q}:")} == {
        f"{Q}:claimed",
        f"{Q}:claim-owners",
        f"{Q}:claims-idx",
        "request-active:r1",
        "request-active:r2",
    }
    ran = cli(acl_redis.user_url("op"), "drain", "-q", Q, "--release-all", conf=config())
    assert ran.returncode == 1
    assert mask_noperm(ran.stderr).splitlines()[-1] == (
        f"claimkit: Redis at redis://op:***@127.0.0.1:{acl_redis.port}/0 refused a command "
        "under its ACL: user 'op' may not run MULTI: grant +multi (Redis: NOPERM <server's "
        "words>); nothing was written; `claimkit acl` "
        "prints the rule claimkit needs (docs/security.md)"
    )
    assert "Traceback" not in ran.stderr
    assert state(acl_redis.admin) == before


@pytest.mark.parametrize("backend", ["coredis", "redispy"])
def test_a_refused_key_inside_a_script_is_looked_up_in_acl_log(
    acl_redis: AclRedis, backend: str
) -> None:
    script = "return redis.call('SET', KEYS[2], 1)"
    for user, extra in (("logs", "+acl|log"), ("nolog", "")):
        acl_redis.setuser(user, f"resetkeys -@all +eval +evalsha {extra} ~a".strip())

    async def refused(user: str) -> StorePermissionError:
        async with open_store(acl_redis.user_url(user), backend=backend) as store:
            with pytest.raises(StorePermissionError) as caught:
                await store.command("EVAL", script, 2, "a", "b")
        return caught.value

    for user, named in (("logs", "key 'b'"), ("nolog", "one of the keys of EVAL")):
        error = trio.run(refused, user)
        assert error.user == user
        assert f"user {user!r} may not access {named}" in str(error)
        if user == "nolog":
            assert "('a', 'b'; ACL LOG, which names it, is refused too)" in str(error)
        else:
            assert error.key == "b"


@pytest.mark.parametrize("backend", ["coredis", "redispy"])
def test_a_refused_exec_writes_nothing_and_the_pool_stays_usable(
    acl_redis: AclRedis, backend: str
) -> None:
    acl_redis.setuser("noexec", "resetkeys -@all +multi +set +get ~*")

    async def main() -> None:
        with trio.fail_after(30):
            async with open_store(acl_redis.user_url("noexec"), backend=backend) as store:
                with pytest.raises(StorePermissionError, match="may not run EXEC: grant \\+exec"):
                    await store.pipeline([("SET", "k", "v")], transaction=True)
                # No connection was left inside MULTI: this GET is not queued but answered.
                assert await store.command("GET", "k") is None

    trio.run(main)


def test_rule_keys_come_from_the_key_builder() -> None:
    conf = load_config(inline=json.dumps({**config(), "url": "redis://h"}))
    producer = acl_rule(conf, "producer", queues=["other*queue"])
    assert producer.keys == (
        Q,
        f"request-seq:{Q}:*",
        "other\\*queue",
        "request-seq:other\\*queue:*",
        "result-list",
        "result-list:result-claimed",
        "result-list:result-claim-owners",
        "result-list:result-claims-idx",
        "result-list:result-ack-tombstones",
        "result-terminal:*",
        "request-active:*",
        "request-cancel:*",
        "request-payload:*",
    )
    # submit runs its script (lua/submit-1.lua); no MULTI but cancel's
    assert {"evalsha", "eval", "incr", "expireat", "zadd", "set", "del"} <= set(producer.commands)
    consumer = acl_rule(conf, "consumer")
    assert "budget:requests" in consumer.keys
    assert {"evalsha", "eval", "hset", "zadd"} <= set(consumer.commands)
    assert "multi" not in consumer.commands
    # payload references: fetched with MGET, deleted inside the ack script (its DEL)
    assert consumer.keys[-2:] == ("request-payload:*", "budget:requests")
    assert {"mget", "del"} <= set(consumer.commands)


@pytest.mark.parametrize("backend", ["coredis", "redispy"])
def test_a_refused_multi_writes_nothing_on_either_backend(
    acl_redis: AclRedis, backend: str
) -> None:
    async def main() -> None:
        with trio.fail_after(30):
            async with open_store(acl_redis.user_url("nomulti"), backend=backend) as store:
                producer = Producer(store, Q)
                with pytest.raises(StorePermissionError) as caught:
                    await store.pipeline([("SET", "k", "v"), ("ZADD", Q, 1, "m")], transaction=True)
                assert (caught.value.command, caught.value.written) == ("MULTI", False)
                assert str(caught.value).startswith(
                    "user 'nomulti' may not run MULTI: grant +multi"
                )
                # Cancel reads its keys' types in one transaction: refused, nothing written.
                with pytest.raises(StorePermissionError, match="nothing was written"):
                    await producer.cancel("r1")

    acl_redis.setuser("nomulti", "resetkeys -@all +exec +set +get +zadd +del +time +type ~*")
    trio.run(main)
    assert state(acl_redis.admin) == {}


def test_serve_stops_on_an_acl_refusal_instead_of_retrying_for_ever(
    acl_redis: AclRedis, tmp_path: Path
) -> None:
    """A consumer user that may not run scripts: the first claim is refused. Retrying cannot
    mend an ACL, so serve stops with the one line naming the user and the command, exit 1,
    and the request stays pending byte for byte."""
    conf = config()
    rule = rules_for(conf)["consumer"] + " -evalsha -eval"
    acl_redis.setuser("narrow", rule)
    assert submit(acl_redis.admin, "r1").returncode == 0
    before = redis(acl_redis.admin, lambda s: s.command("ZRANGE", Q, 0, -1, "WITHSCORES"))
    log = tmp_path / "serve.log"
    proc = serve(acl_redis.user_url("narrow"), conf, log)
    try:
        assert proc.wait(60) == 1, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    lines = log.read_text().splitlines()
    final = lines[-1]
    assert final.startswith(
        f"claimkit: Redis at redis://narrow:***@127.0.0.1:{acl_redis.port}/0 refused a command "
        "under its ACL: user 'narrow' may not run EVALSHA"
    ), lines
    assert sum("refused a command under its ACL" in line and "stopping" in line for line in lines)
    after = redis(acl_redis.admin, lambda s: s.command("ZRANGE", Q, 0, -1, "WITHSCORES"))
    assert after == before
    assert redis(acl_redis.admin, lambda s: s.command("HLEN", f"{Q}:claim-owners")) == 0


def test_a_queue_name_with_a_space_gets_a_pattern_redis_takes(acl_redis: AclRedis) -> None:
    """Redis refuses a key pattern with a space: a queue named ``a b*`` gets ``a?b\\*`` (the
    star literal), which redis-cli takes as printed and which lets the user write that queue."""
    conf = {"queues": [{"queue_name": "a b*", "igw_base_url": "http://127.0.0.1:9"}]}
    argv = ["acl", "--role", "producer", "--user", "spaced", "--transport-config"]
    result = CliRunner().invoke(app, [*argv, json.dumps(conf)])
    assert result.exit_code == 0, result.output
    line = result.stdout.strip()
    assert " ~a?b\\* " in f"{line} "
    cli = shutil.which("redis-cli")
    if cli is None:
        pytest.skip("redis-cli is not on PATH")
    args = [cli, "-p", str(acl_redis.port), "--user", "default", "--pass", ADMIN_PASSWORD]
    # Pasted at redis-cli's prompt (stdin is a pipe here): its own parser reads the line.
    done = subprocess.run(
        [*args, "--no-auth-warning"], input=line + "\n", capture_output=True, text=True
    )
    assert done.stdout.strip() == "OK", done
    redis(acl_redis.admin, lambda s: s.command("ACL", "SETUSER", "spaced", ">pw-spaced"))
    request = json.dumps({"id": "r1", "deadline": int(time.time()) + 600, "payload": {}})
    for queue, code in (("a b*", 0), (Q, 1)):  # its own queue, and not another one
        done = subprocess.run(
            [CLAIMKIT, "submit", "-q", queue, request],
            env={**os.environ, "REDIS_URL": acl_redis.user_url("spaced")},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == code, done.stderr
    assert redis(acl_redis.admin, lambda s: s.command("ZCARD", "a b*")) == 1
    assert redis(acl_redis.admin, lambda s: s.command("ZCARD", Q)) == 0
