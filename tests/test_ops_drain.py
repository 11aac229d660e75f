"""``drain --release-all`` logic (SPEC §3.6): every claim back at its original score,
fenced per claim by the owner token and the lease expiry read just before."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest
import trio
from support import StoreWrapper, member, server_now

from claimkit.ops.drain import DrainReport, drain_claims
from claimkit.protocol.ops import CHUNK

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from claimkit.store import Arg, Store
    from claimkit.store.scripts import Script

Q = "jobs"


async def seed_claims(store: Store, n: int, *, start: int = 0) -> dict[bytes, float]:
    """``n`` claims as SPEC §1 lays them out; returns member -> original score."""
    now = await server_now(store)
    expected: dict[bytes, float] = {}
    commands: list[Sequence[Arg]] = []
    for i in range(start, start + n):
        rid = f"r{i:05d}"
        score = int(now) + 1000 + i
        raw = member(rid, score)
        expected[raw] = float(score)
        commands += [
            ("HSET", f"{Q}:claimed", rid, raw, f"{rid}:score", score),
            ("HSET", f"{Q}:claim-owners", rid, f"{i:032x}"),
            ("ZADD", f"{Q}:claims-idx", repr(now + 60 + i / 1000), rid),
        ]
    await store.pipeline(commands, transaction=True)
    return expected


async def pending(store: Store) -> dict[bytes, float]:
    return {m: float(s) for m, s in await store.command("ZRANGE", Q, 0, -1, "WITHSCORES")}


async def claim_keys_empty(store: Store) -> bool:
    counts = [
        await store.command("HLEN", f"{Q}:claimed"),
        await store.command("HLEN", f"{Q}:claim-owners"),
        await store.command("ZCARD", f"{Q}:claims-idx"),
    ]
    return counts == [0, 0, 0]


class RacingStore(StoreWrapper):
    """A store that runs ``meddle`` right before the release script: a consumer acting
    between drain's read and its release."""

    def __init__(self, inner: Store, meddle: Callable[[Store], Awaitable[None]]) -> None:
        super().__init__(inner)
        self.meddle = meddle

    async def run(self, script: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        if script.name == "release":
            await self.meddle(self.inner)
        return await self.inner.run(script, keys, args)


async def test_every_claim_goes_back_at_its_original_score_in_batches(store: Store) -> None:
    with trio.fail_after(30):
        expected = await seed_claims(store, 2 * CHUNK + 1)
        done: list[int] = []
        totals: list[int] = []
        report = await drain_claims(
            store, Q, batch_size=CHUNK, progress=done.append, on_start=totals.append
        )
        assert report == DrainReport(seen=2 * CHUNK + 1, released=2 * CHUNK + 1)
        assert totals == [2 * CHUNK + 1]
        assert done == [CHUNK, CHUNK, 1]
        assert await pending(store) == expected
        assert await claim_keys_empty(store)
        again = await drain_claims(store, Q)
        assert again == DrainReport(), "a second run finds nothing"


async def test_dry_run_changes_nothing(store: Store) -> None:
    with trio.fail_after(10):
        await seed_claims(store, 5)
        before = {k: await store.command("DUMP", k) for k in await store.command("KEYS", "*")}
        report = await drain_claims(store, Q, dry_run=True, batch_size=2)
        assert report == DrainReport(seen=5, released=5)
        after = {k: await store.command("DUMP", k) for k in await store.command("KEYS", "*")}
        assert after == before
        assert "would release 5 of 5" in report.line(Q, dry_run=True)


@pytest.mark.parametrize(
    ("meddling", "field"),
    [
        ("renew", "renewed"),
        ("steal", "other_owner"),
        ("ack", "gone"),
    ],
)
async def test_a_claim_changed_meanwhile_is_left_alone(
    store: Store, meddling: str, field: str
) -> None:
    with trio.fail_after(10):
        expected = await seed_claims(store, 3)
        victim = "r00001"
        victim_member = next(m for m in expected if json.loads(m)["data"]["id"] == victim)

        async def meddle(inner: Store) -> None:
            if meddling == "renew":
                await inner.command("ZADD", f"{Q}:claims-idx", "XX", "9999999999", victim)
            elif meddling == "steal":
                await inner.command("HSET", f"{Q}:claim-owners", victim, "f" * 32)
            else:
                await inner.pipeline(
                    [
                        ("HDEL", f"{Q}:claimed", victim, f"{victim}:score"),
                        ("HDEL", f"{Q}:claim-owners", victim),
                        ("ZREM", f"{Q}:claims-idx", victim),
                    ],
                    transaction=True,
                )

        report = await drain_claims(RacingStore(store, meddle), Q)

        assert report.seen == 3
        assert report.released == 2
        assert getattr(report, field) == 1
        released = {m: s for m, s in expected.items() if m != victim_member}
        assert await pending(store) == released
        if meddling != "ack":
            assert await store.command("HGET", f"{Q}:claimed", victim) == victim_member


async def test_ghost_index_entries_are_skipped(store: Store) -> None:
    with trio.fail_after(10):
        expected = await seed_claims(store, 1)
        await store.command("ZADD", f"{Q}:claims-idx", 1, "ghost")
        report = await drain_claims(store, Q)
        assert report == DrainReport(seen=2, released=1, ghosts=1)
        assert await pending(store) == expected
        assert await store.command("ZRANGE", f"{Q}:claims-idx", 0, -1) == [b"ghost"]


async def test_batch_size_must_be_positive(store: Store) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        await drain_claims(store, Q, batch_size=0)


def test_report_lines() -> None:
    report = DrainReport(seen=4, released=1, gone=1, renewed=1, other_owner=1)
    assert report.line("q") == (
        "claimkit drain q: released=1 of 4 claims gone=1 renewed=1 other_owner=1 ghosts=0"
    )
    assert DrainReport(seen=3, released=2, ghosts=1).line("q", dry_run=True) == (
        "claimkit drain q: dry run: would release 2 of 3 claims (1 ghosts skipped); nothing changed"
    )
