"""``claimkit results --follow --exec`` as operators run it: the installed console script,
several readers on one list, one SIGKILLed while it holds a leased record
(docs/results.md).

Every process is started here and stopped by its PID (the killed reader by its own process
group and by its ``--exec`` shell's, a group of its own). Waiting is done by polling Redis
state and the readers' output files against an absolute deadline; nothing asserts on
timing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from support import do, pairs, wait_until

from claimkit.protocol.keys import ResultClaimKeys

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = pytest.mark.slow

CLAIMKIT = Path(sys.executable).with_name("claimkit")
L = "res"
K = ResultClaimKeys.for_list(L)
N = 200
BAD = b'{"id": "broken", not json'


class Readers:
    """``claimkit results --follow`` children, output in files, all killed at teardown."""

    def __init__(self, directory: Path, url: str) -> None:
        self.directory, self.url = directory, url
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, command: str, *, lease: str = "2") -> subprocess.Popen[bytes]:
        args = [
            *(str(CLAIMKIT), "results", "--follow", "--list", L, "--redis-url", self.url),
            *("--lease", lease, "--poll", "0.05", "--exec", command),
        ]
        with (self.directory / f"{name}.err").open("wb") as err:
            proc = subprocess.Popen(
                args, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
            )
        self.procs[name] = proc
        return proc

    def err(self, name: str) -> str:
        return (self.directory / f"{name}.err").read_text(errors="replace")

    def lines(self, name: str) -> list[str]:
        path = self.directory / f"{name}.jsonl"
        return path.read_text().splitlines() if path.exists() else []

    def alive(self, *names: str) -> None:
        for name in names:
            assert self.procs[name].poll() is None, self.err(name)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


@pytest.fixture
def readers(tmp_path: Path, redis_url: str) -> Iterator[Readers]:
    group = Readers(tmp_path, redis_url)
    try:
        yield group
    finally:
        group.close()


def record(i: int) -> bytes:
    doc: dict[str, object] = {"id": f"r{i}", "status_code": 200, "payload": f'{{"n":{i}}}'}
    if i % 2 == 0:
        doc["request_token"] = f"g{i}"
    return json.dumps(doc, separators=(",", ":")).encode()


def claim_id(i: int) -> bytes:
    return f"r{i}\0g{i}".encode() if i % 2 == 0 else f"r{i}".encode()


def test_three_readers_one_killed_every_record_acked_once(
    readers: Readers, redis_url: str, tmp_path: Path
) -> None:
    records = [record(i) for i in range(N)]
    # Oldest first: LPUSH in order, the malformed record in the middle of the stream.
    do(redis_url, ("LPUSH", L, *records[:100], BAD, *records[100:]))
    d = tmp_path
    for name in ("a", "c"):
        readers.start(name, f"sleep 0.01; {{ cat; echo; }} >> {d}/{name}.jsonl")
    # b records what it holds; once armed, it sleeps holding its record (the lease is
    # renewed meanwhile) and is SIGKILLed there, with its --exec command (in a process group
    # of its own, docs/results.md#ctrl-c-and---exec; the shell's pid is that group's id).
    readers.start(
        "b",
        f"cat > {d}/b.current; if [ -e {d}/b.arm ]; then echo $$ > {d}/b.pgid; "
        f"cp {d}/b.current {d}/b.held; "
        f"sleep 60; fi; {{ cat {d}/b.current; echo; }} >> {d}/b.jsonl",
    )

    def b_worked() -> bool:
        readers.alive("a", "b", "c")
        return len(readers.lines("b")) >= 3

    wait_until("reader b to handle a few records", b_worked, 60)
    (d / "b.arm").touch()
    wait_until("reader b to hold a record", lambda: (d / "b.held").exists(), 60)
    held = (d / "b.held").read_bytes()
    held_id = claim_id(records.index(held))
    # b holds it leased, not acked, when it dies.
    assert do(redis_url, ("HGET", K.claimed, held_id))[0] == held
    os.killpg(int((d / "b.pgid").read_text()), signal.SIGKILL)
    os.killpg(readers.procs["b"].pid, signal.SIGKILL)
    readers.procs["b"].wait(timeout=10)

    def all_acked() -> bool:
        readers.alive("a", "c")
        tombstones, claimed = do(redis_url, ("ZCARD", K.tombstones), ("HLEN", K.claimed))
        return bool(tombstones == N and claimed == 1)

    wait_until("every record to be acked", all_acked, 120)

    tombstones = do(redis_url, ("ZRANGE", K.tombstones, 0, -1))[0]
    assert sorted(tombstones) == sorted(claim_id(i) for i in range(N))  # each exactly once
    assert do(redis_url, ("EXISTS", L))[0] == 0
    # Only the malformed record is left: leased (claimed, an owner, a lease), never deleted.
    ((bad_id, bad_bytes),) = pairs(do(redis_url, ("HGETALL", K.claimed))[0])
    assert bad_bytes == BAD
    assert bad_id.startswith(b"\0unparsable-result\0")
    assert [f for f, _ in pairs(do(redis_url, ("HGETALL", K.owners))[0])] == [bad_id]
    assert do(redis_url, ("ZRANGE", K.index, 0, -1))[0] == [bad_id]
    # The killed reader's record went to a survivor after its lease.
    survivors = readers.lines("a") + readers.lines("c")
    assert held.decode() in survivors
    assert held.decode() not in readers.lines("b")
    handled = survivors + readers.lines("b")
    assert set(handled) == {r.decode() for r in records}
    # The malformed record was reported on stderr by whoever met it, in one line.
    report = (
        f"claimkit results: {L}: unparsable record of {len(BAD)} bytes (not JSON (Expecting "
        "property name enclosed in double quotes: line 1 column 18 (char 17))), left leased "
        "as claim '\\x00unparsable-result\\x00"
    )
    errs = readers.err("a") + readers.err("b") + readers.err("c")
    assert report in errs, errs
    assert "Traceback" not in errs
    for name in ("a", "c"):
        os.kill(readers.procs[name].pid, signal.SIGINT)
        assert readers.procs[name].wait(timeout=20) == 0, readers.err(name)


def test_a_failed_exec_is_not_acked_and_comes_back(
    readers: Readers, redis_url: str, tmp_path: Path
) -> None:
    d = tmp_path
    do(redis_url, ("LPUSH", L, record(1)))
    proc = readers.start(
        "a",
        f"if [ -e {d}/ok ]; then {{ cat; echo; }} >> {d}/a.jsonl; else exit 3; fi",
        lease="0.5",
    )

    def refused() -> bool:
        readers.alive("a")
        return "--exec exited with status 3" in readers.err("a")

    wait_until("the failed --exec line", refused, 30)
    assert readers.err("a").splitlines()[0] == (
        f"claimkit results: {L}: --exec exited with status 3 for result 'r1': not acked; it "
        "is delivered again after the lease (0.5 s)"
    )
    assert do(redis_url, ("EXISTS", K.tombstones))[0] == 0
    (d / "ok").touch()

    def acked() -> bool:
        readers.alive("a")
        return bool(do(redis_url, ("ZRANGE", K.tombstones, 0, -1))[0] == [b"r1"])

    wait_until("the record to come back and be acked", acked, 30)
    assert readers.lines("a") == [record(1).decode()]
    assert do(redis_url, ("EXISTS", L, K.claimed, K.owners, K.index))[0] == 0
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=20) == 0
