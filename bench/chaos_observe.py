"""What the chaos harness (``bench/chaos.py``) watches: Redis snapshots and the MONITOR log.

Two independent views of one run:

- :data:`SNAPSHOT`: a read-only Lua script that reads every structure a request can live in
  (pending, claims, retry set, dead sets, result list) in one atomic step, so a sample never
  sees a request "between" two structures. :class:`Locations` turns a reply into, for every
  request id, the places it is in at that instant.
- :class:`Monitor`: a thread reading Redis ``MONITOR``. Every claim-protocol script call is
  logged with the commands it ran (``[0 lua]`` lines follow their ``EVAL``/``EVALSHA``
  line), which gives the poll batches (one claim call each, candidates in order), every
  claim with its token and server time, every reclaim, every ack with the token it used and
  whether its record was pushed, and every retry park.

Neither view changes anything in Redis.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import socket
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from claimkit.protocol.keys import QueueKeys, key_slot
from claimkit.protocol.models import Envelope
from claimkit.protocol.models import parse_member as parse_envelope
from claimkit.store.scripts import Script, all_scripts

# -- the atomic snapshot -----------------------------------------------------------------------

_SNAPSHOT_SOURCE = """#!lua flags=no-writes
-- chaos snapshot: read, atomically, every place a request can be (read-only).
-- KEYS: pending, claimed, owners, index, retry, dead, retry dead, outbox, and as KEYS[9]
--       the result list when it is in the same slot (always, but on a cluster whose
--       result list is in another slot than the queue)
-- ARGV[1]: how many result records the caller already has (records are only LPUSHed
--          during a chaos run, so the new ones are the head of the list); unused without
--          KEYS[9]
-- (flags=no-writes: it runs while Redis refuses writes, too.)
-- Returns: { sec, usec, pending (member, score)*, claimed (field, value)*, owners
--            (id, token)*, index (id, expiry)*, retry members, dead members,
--            retry dead members, outbox (field, entry)*, and with KEYS[9]: result count,
--            new records (newest first) }
local t = redis.call('TIME')
local out = {
  t[1], t[2],
  redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES'),
  redis.call('HGETALL', KEYS[2]),
  redis.call('HGETALL', KEYS[3]),
  redis.call('ZRANGE', KEYS[4], 0, -1, 'WITHSCORES'),
  redis.call('ZRANGE', KEYS[5], 0, -1),
  redis.call('ZRANGE', KEYS[6], 0, -1),
  redis.call('ZRANGE', KEYS[7], 0, -1),
  redis.call('HGETALL', KEYS[8]),
}
if #KEYS == 9 then
  local n = redis.call('LLEN', KEYS[9])
  local known = tonumber(ARGV[1])
  local new = {}
  if n > known then new = redis.call('LRANGE', KEYS[9], 0, n - known - 1) end
  out[#out + 1] = n
  out[#out + 1] = new
end
return out
"""

_RESULTS_SOURCE = """#!lua flags=no-writes
-- chaos result read: the result list's length and the records the caller does not have.
-- KEYS[1]: the result list. ARGV[1]: how many records the caller already has.
-- Returns: { result count, new records (newest first) }
local n = redis.call('LLEN', KEYS[1])
local known = tonumber(ARGV[1])
local new = {}
if n > known then new = redis.call('LRANGE', KEYS[1], 0, n - known - 1) end
return { n, new }
"""


def _script(name: str, numkeys: int, source: str) -> Script:
    return Script(
        name, numkeys, source, hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()
    )


SNAPSHOT = _script("chaos-snapshot", 9, _SNAPSHOT_SOURCE)
"""The queue's keys and the result list in one slot: one atomic read of everything."""
QUEUE_SNAPSHOT = _script("chaos-snapshot", 8, _SNAPSHOT_SOURCE)
"""The queue's keys alone (a cluster whose result list is in another slot)."""
RESULTS_READ = _script("chaos-results", 1, _RESULTS_SOURCE)
"""The result list alone: its length and new records in one atomic step."""


@dataclass(frozen=True)
class ChaosKeys:
    """Every key the harness reads, in the layout the consumers use: the queue's keys are
    :class:`~claimkit.protocol.keys.QueueKeys` (standalone and sentinel: docs/protocol.md#keys,
    the retry set and its dead set global; cluster: docs/topology.md#cluster-key-layout, the
    retry set per queue and cross-slot acks through the outbox ``{q}:outbox``); the result
    list keeps its name in every layout. The outbox is read in every mode (outside a cluster
    it never exists): standalone, its cluster-layout name.
    """

    queue: QueueKeys
    results: str
    outbox: str

    @classmethod
    def for_run(cls, queue: str, retry: str, results: str, *, cluster: bool) -> ChaosKeys:
        keys = QueueKeys.for_queue(queue, cluster=cluster, retry_set=retry)
        outbox = keys.outbox or QueueKeys.for_queue(queue, cluster=True).outbox
        assert outbox is not None
        return cls(keys, results, outbox)

    @property
    def one_slot(self) -> bool:
        """Whether the result list shares the queue's slot: one atomic snapshot reads all."""
        return not self.queue.cluster or key_slot(self.results) == key_slot(self.queue.pending)

    def queue_keys(self) -> list[str]:
        """KEYS of :data:`QUEUE_SNAPSHOT`, all in the queue's slot."""
        k = self.queue
        return [
            k.pending,
            k.claimed,
            k.owners,
            k.index,
            k.retry_set,
            k.dead,
            k.retry_dead,
            self.outbox,
        ]

    def snapshot_keys(self) -> list[str]:
        """KEYS of :data:`SNAPSHOT`: the queue's keys, then the result list."""
        return [*self.queue_keys(), self.results]


def _b(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def _flat_pairs(reply: Any) -> list[tuple[bytes, bytes]]:
    if isinstance(reply, dict):
        return [(_b(k), _b(v)) for k, v in reply.items()]
    items = list(reply)
    return [(_b(items[i]), _b(items[i + 1])) for i in range(0, len(items), 2)]


@dataclass(frozen=True, slots=True)
class Member:
    """What the harness needs of one envelope: its id, generation, deadline and pending
    score (its deadline and enqueue order, docs/protocol.md#enqueue-order; the deadline
    for a member the consumer would not parse)."""

    id: str | None
    token: str
    deadline: float | None
    score: float | None = None


_member_cache: dict[bytes, Member] = {}


def parse_member(raw: bytes) -> Member:
    """Best-effort reading of a member (cached: the same bytes are seen many times)."""
    found = _member_cache.get(raw)
    if found is not None:
        return found
    rid: str | None = None
    token = ""
    deadline: float | None = None
    try:
        doc = json.loads(raw)
        data = doc.get("data") if isinstance(doc, dict) else None
        internal = doc.get("internal") if isinstance(doc, dict) else None
        if isinstance(data, dict):
            if isinstance(data.get("id"), str):
                rid = data["id"]
            if isinstance(data.get("deadline"), int | float) and not isinstance(
                data.get("deadline"), bool
            ):
                deadline = float(data["deadline"])
        if isinstance(internal, dict) and isinstance(internal.get("request_token"), str):
            token = internal["request_token"]
    except ValueError:
        pass
    env = parse_envelope(raw)
    found = Member(rid, token, deadline, env.score if isinstance(env, Envelope) else deadline)
    if len(_member_cache) < 200_000:
        _member_cache[raw] = found
    return found


@dataclass
class Locations:
    """Where every request is at one instant (from one :data:`SNAPSHOT` or
    :data:`QUEUE_SNAPSHOT` reply).

    Attributes:
        server_time: Redis server clock at the snapshot (Unix seconds).
        places: id -> list of place names, one entry per copy ("pending", "claimed",
            "retry", "dead", "outbox"); records are not listed here (see
            :func:`location_problem`).
        problems: structural faults seen in this snapshot alone (a claim whose entries are
            not all present, a pending score that is not its own).
        result_count: length of the result list (``None`` when not read: QUEUE_SNAPSHOT).
        new_records: records pushed since the caller's last snapshot, oldest first.
        outbox_count: entries in the cluster outbox.
    """

    server_time: float
    places: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    problems: list[str] = field(default_factory=list)
    result_count: int | None = None
    new_records: list[bytes] = field(default_factory=list)
    claims: dict[str, tuple[str, float]] = field(default_factory=dict)
    pending_count: int = 0
    retry_count: int = 0
    outbox_count: int = 0

    @classmethod
    def from_reply(cls, reply: Any) -> Locations:
        sec, usec = int(reply[0]), int(reply[1])
        loc = cls(server_time=sec + usec / 1e6)
        pending = _flat_pairs(reply[2])
        claimed = dict(_flat_pairs(reply[3]))
        owners = dict(_flat_pairs(reply[4]))
        index = dict(_flat_pairs(reply[5]))
        loc.pending_count = len(pending)
        for raw, score in pending:
            m = parse_member(raw)
            loc.places[m.id if m.id is not None else "<unreadable>"].append("pending")
            if m.score is not None and float(score) != m.score:
                loc.problems.append(
                    f"pending member of {m.id!r} scored {float(score)}, its own score {m.score}"
                )
        seen_fields: set[bytes] = set()
        for rid_b, token in owners.items():
            rid = rid_b.decode(errors="replace")
            loc.places[rid].append("claimed")
            score_field = rid_b + b":score"
            seen_fields.update((rid_b, score_field))
            if rid_b not in claimed or score_field not in claimed or rid_b not in index:
                loc.problems.append(f"claim on {rid!r} is torn (owner without payload/score/index)")
            loc.claims[rid] = (token.decode(), float(index.get(rid_b, b"0")))
        for fld in claimed:
            if fld not in seen_fields:
                loc.problems.append(f"claimed field {fld!r} has no owner")
        for rid_b in index:
            if rid_b not in owners:
                loc.problems.append(f"lease index entry {rid_b!r} has no owner")
        for raw in reply[6]:
            loc.retry_count += 1
            m = parse_member(_b(raw))
            loc.places[m.id if m.id is not None else "<unreadable>"].append("retry")
        for raw in list(reply[7]) + list(reply[8]):
            m = parse_member(_b(raw))
            loc.places[m.id if m.id is not None else "<unreadable>"].append("dead")
        for fld, _entry in _flat_pairs(reply[9]):
            # field: <id> NUL <ownership token>
            loc.outbox_count += 1
            loc.places[fld.split(b"\0", 1)[0].decode(errors="replace")].append("outbox")
        if len(reply) > 10:
            loc.result_count = int(reply[10])
            loc.new_records = [_b(r) for r in reversed(list(reply[11]))]
        return loc

    @property
    def busy(self) -> bool:
        """Whether anything is still pending, claimed, waiting to retry or in the outbox."""
        return bool(self.claims or self.pending_count or self.retry_count or self.outbox_count)


LIVE_PLACES = ("pending", "claimed", "retry")
"""Where a request is a live copy, one that may still run."""


def location_problem(
    places: list[str], *, record_before: bool, record_after: bool, accepted: bool
) -> str | None:
    """What is wrong with one request's places at one sample, or ``None``.

    ``places`` is its entries in the queue's keys (:attr:`Locations.places`);
    ``record_before`` whether it had a terminal record when the queue's keys were read, and
    ``record_after`` whether it had one when the result list was read after them (both the
    same when one script read all). The rule: at most one live copy (pending, claimed,
    retry), never beside its record or a dead or outbox entry; at most one dead and one
    outbox entry; an accepted request is somewhere. A record that appeared between the two
    reads may sit beside a live copy (it was acked in between), and an outbox entry beside
    its record (pushed, not yet dropped) or its dead entry (a dead-letter record on its way).
    """
    live = [p for p in places if p in LIVE_PLACES]
    dead, outbox = places.count("dead"), places.count("outbox")
    if len(live) > 1 or dead > 1 or outbox > 1:
        return "more than one copy"
    if live:
        if dead or outbox:
            return f"{live[0]} and {'dead' if dead else 'outbox'} at once"
        if record_before:
            return f"{live[0]} after its record"
        return None
    if accepted and not (dead or outbox or record_after):
        return "nowhere"
    return None


# -- MONITOR -------------------------------------------------------------------------------------

_LINE = re.compile(rb"^\+(\d+\.\d+) \[\d+ (\S+)\] (.*)$", re.DOTALL)
_ARG = re.compile(rb'"((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(rb"\\(x[0-9a-fA-F]{2}|.)", re.DOTALL)
_SIMPLE_ESCAPES = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"a": b"\a", b"b": b"\b"}


def _unescape(text: bytes) -> bytes:
    def one(m: re.Match[bytes]) -> bytes:
        e = m.group(1)
        if e[:1] == b"x" and len(e) == 3:
            return bytes([int(e[1:], 16)])
        return _SIMPLE_ESCAPES.get(e, e)

    return _ESCAPE.sub(one, text)


def monitor_args(rest: bytes) -> list[bytes]:
    """The arguments of one MONITOR line (after the ``[db client]`` part), unescaped."""
    return [_unescape(m.group(1)) for m in _ARG.finditer(rest)]


@dataclass
class ClaimCall:
    """One claim script call: one poll batch of one consumer."""

    time: float
    client: str
    candidates: list[tuple[str, str, float]]  # (id, token, deadline) in call order
    claimed: list[str] = field(default_factory=list)


@dataclass
class Event:
    time: float
    kind: str  # claim | reclaim | ack | park | release | record
    token: str = ""
    detail: str = ""


_ACK_LAYOUTS = {
    "ack": (8, 2),
    "ack-local": (6, 3),
    "ack-outbox": (7, 0),
    "park": (4, 0),
    "release": (3, 0),
}
"""Per script that ends claims: (ARGV values per item, index of the first item's id)."""

_ACK_ALIASES = {"ack-local": "ack", "ack-outbox": "ack"}
"""Cluster scripts whose items end their claims as ``ack`` does, by the event they log."""


class Monitor(threading.Thread):
    """Reads ``MONITOR`` from one Redis port until :meth:`stop`; reconnects after a crash.

    Set :attr:`port` to follow a primary elsewhere (after a failover): the next reconnect
    goes there. A script call whose arguments do not have the layout expected of its name
    is counted in :attr:`unparsed` and otherwise skipped.

    Attributes:
        events: id -> events in server-time order.
        claim_calls: every claim call seen.
        stale_acks: acks made with a token that no longer owned the claim.
        stale_pushes: of those, how many pushed a record (a late result that was kept).
        gaps: how often the connection was lost (events of the downtime are not seen;
            Redis was down then, so there were none, except in the moment of reconnecting).
    """

    def __init__(self, port: int, keys: ChaosKeys) -> None:
        super().__init__(name=f"chaos-monitor-{port}", daemon=True)
        self.port = port
        self.keys = keys
        self.result_list = keys.results.encode()
        self.unparsed = 0
        self.events: dict[str, list[Event]] = defaultdict(list)
        self.claim_calls: list[ClaimCall] = []
        self.stale_acks = 0
        self.stale_pushes = 0
        self.stale_push_ids: list[str] = []
        self.gaps = 0
        self.lines = 0
        self.connected = threading.Event()
        self._stopping = threading.Event()
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        by_sha = {s.sha1: name for name, s in all_scripts().items()}
        self._by_sha = {sha.encode(): name for sha, name in by_sha.items()}
        self._owner: dict[str, str] = {}
        self._call: str | None = None
        self._call_stale: set[str] = set()
        self._claim_call: ClaimCall | None = None
        self._last_sha: tuple[Any, ...] | None = None
        self._pending: tuple[float, str | None, ClaimCall | None, list[tuple[str, str]]] | None = (
            None
        )
        self._owners_key = self.keys.queue.owners.encode()
        self._deliveries_key = self.keys.queue.deliveries.encode()
        self._prefixes = (
            b'"HSET" "' + self._owners_key + b'"',
            b'"HDEL" "' + self._owners_key + b'"',
            b'"HINCRBY" "' + self._deliveries_key + b'"',
            b'"LPUSH" "' + self.result_list + b'"',
        )

    # -- thread ------------------------------------------------------------------------------

    def run(self) -> None:
        while not self._stopping.is_set():
            try:
                sock = socket.create_connection(("127.0.0.1", self.port), timeout=2)
            except OSError:
                time.sleep(0.02)
                continue
            self._sock = sock
            try:
                sock.settimeout(None)
                sock.sendall(b"*1\r\n$7\r\nMONITOR\r\n")
                stream = sock.makefile("rb")
                if stream.readline().strip() != b"+OK":
                    raise OSError("MONITOR refused")
                self.connected.set()
                for line in stream:
                    self._line(line.rstrip(b"\r\n"))
            except OSError:
                pass
            finally:
                self.connected.clear()
                sock.close()
                self._sock = None
            if not self._stopping.is_set():
                self.gaps += 1

    def stop(self) -> None:
        self._stopping.set()
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.join(timeout=10)

    # -- parsing -----------------------------------------------------------------------------

    def _line(self, line: bytes) -> None:
        self.lines += 1
        match = _LINE.match(line)
        if match is None:
            return
        ts, client, rest = float(match.group(1)), match.group(2), match.group(3)
        if client != b"lua":
            self._pending = None  # the previous call ran nothing
            if rest.startswith((b'"EVALSHA"', b'"EVAL"')):
                self._outer(ts, client.decode(), rest)
            else:
                self._call = None
            return
        if self._pending is not None:
            with self._lock:
                self._commit()
        if not rest.startswith(self._prefixes):
            return
        args = monitor_args(rest)
        with self._lock:
            self._inner(ts, args)

    def _commit(self) -> None:
        """The call ran (a script refused by Redis, say when out of memory, shows in
        MONITOR too, but runs no command): log what it was asked to do."""
        assert self._pending is not None
        ts, name, claim_call, items = self._pending
        self._pending = None
        if claim_call is not None:
            self._claim_call = claim_call
            self.claim_calls.append(claim_call)
        for rid, token in items:
            self.events[rid].append(Event(ts, name or "?", token))
            if name == "ack" and self._owner.get(rid) != token:
                self.stale_acks += 1
                self._call_stale.add(rid)

    def _outer(self, ts: float, client: str, rest: bytes) -> None:
        args = monitor_args(rest)
        if len(args) < 3:
            self._call = None
            return
        if args[0] == b"EVALSHA":
            name = self._by_sha.get(args[1])
        else:
            sha = hashlib.sha1(args[1], usedforsecurity=False).hexdigest().encode()
            name = self._by_sha.get(sha)
        key = (client, name, tuple(args[2:]))
        # A cluster's one-slot ack and its outbox move end the claim as the ack does.
        kind = _ACK_ALIASES.get(name, name) if name is not None else None
        if args[0] == b"EVAL" and key == self._last_sha:
            self._call = kind  # the reload after NOSCRIPT: the same call, already logged
            return
        self._last_sha = key if args[0] == b"EVALSHA" else None
        self._call = kind
        self._call_stale = set()
        self._claim_call = None
        try:
            self._pending = (ts, kind, *self._items(name, ts, client, args))
        except (ValueError, IndexError):
            self.unparsed += 1
            self._pending = (ts, kind, None, [])

    @staticmethod
    def _items(
        name: str | None, ts: float, client: str, args: list[bytes]
    ) -> tuple[ClaimCall | None, list[tuple[str, str]]]:
        """The poll batch of a claim call, or the (id, token) items of an ack, park or
        release call, from its EVAL/EVALSHA arguments."""
        numkeys = int(args[2])
        argv = args[3 + numkeys :]
        claim_call = None
        items: list[tuple[str, str]] = []
        if name == "claim":
            cands = []
            for i in range(2, len(argv) - 4, 5):
                cands.append((argv[i + 1].decode(), argv[i + 2].decode(), float(argv[i + 3])))
            claim_call = ClaimCall(ts, client, cands)
        elif name in _ACK_LAYOUTS:
            # ARGV layouts of lua/ack-5.lua, ack-local-9.lua (cluster, one slot),
            # ack-outbox-6.lua (cluster, step 1 of an ack across slots), park-4.lua and
            # release-4.lua: (values per item, index of the first).
            step, start = _ACK_LAYOUTS[name]
            for i in range(start, len(argv) - step + 1, step):
                items.append((argv[i].decode(), argv[i + 1].decode()))
        return claim_call, items

    def _inner(self, ts: float, args: list[bytes]) -> None:
        cmd = args[0]
        if cmd == b"HSET" and len(args) >= 4:
            rid, token = args[2].decode(), args[3].decode()
            self._owner[rid] = token
            self.events[rid].append(Event(ts, "claim", token))
            if self._call == "claim" and self._claim_call is not None:
                self._claim_call.claimed.append(rid)
        elif cmd == b"HDEL" and len(args) >= 3:
            self._owner.pop(args[2].decode(), None)
        elif cmd == b"HINCRBY" and len(args) >= 3:
            self.events[args[2].decode()].append(Event(ts, "reclaim"))
        elif cmd == b"LPUSH" and len(args) >= 3:
            try:
                rid = json.loads(args[2])["id"]
            except (ValueError, KeyError, TypeError):
                return
            self.events[rid].append(Event(ts, "record", detail=self._call or "?"))
            if self._call == "ack" and rid in self._call_stale:
                self.stale_pushes += 1
                self.stale_push_ids.append(rid)

    # -- queries -----------------------------------------------------------------------------

    def events_of(self, rid: str) -> list[Event]:
        with self._lock:
            return list(self.events.get(rid, ()))


class MonitorSet:
    """One :class:`Monitor` per node that runs the run's scripts, read as one.

    Standalone and sentinel: one (the primary). Cluster: the queue's primary (claims,
    reclaims, acks, parks), and the result list's primary when it is another node (its
    pushes). Events are merged in server-time order (one machine, one clock).
    """

    def __init__(self, monitors: list[Monitor]) -> None:
        self.monitors = monitors

    def start(self) -> None:
        for m in self.monitors:
            m.start()

    def stop(self) -> None:
        for m in self.monitors:
            m.stop()

    def wait_connected(self, timeout: float) -> bool:
        return all(m.connected.wait(timeout) for m in self.monitors)

    def events_of(self, rid: str) -> list[Event]:
        if len(self.monitors) == 1:
            return self.monitors[0].events_of(rid)
        merged = [e for m in self.monitors for e in m.events_of(rid)]
        return sorted(merged, key=lambda e: e.time)

    @property
    def events(self) -> dict[str, list[Event]]:
        out: dict[str, list[Event]] = defaultdict(list)
        for m in self.monitors:
            with m._lock:
                for rid, evs in m.events.items():
                    out[rid].extend(evs)
        return out

    @property
    def claim_calls(self) -> list[ClaimCall]:
        return sorted((c for m in self.monitors for c in m.claim_calls), key=lambda c: c.time)

    @property
    def stale_acks(self) -> int:
        return sum(m.stale_acks for m in self.monitors)

    @property
    def stale_pushes(self) -> int:
        return sum(m.stale_pushes for m in self.monitors)

    @property
    def stale_push_ids(self) -> list[str]:
        return [rid for m in self.monitors for rid in m.stale_push_ids]

    @property
    def gaps(self) -> int:
        return sum(m.gaps for m in self.monitors)

    @property
    def unparsed(self) -> int:
        return sum(m.unparsed for m in self.monitors)


def redelivery_of(events: list[Event], token: str, since: float) -> tuple[str, float | None]:
    """What became of a claim (``token``) held at ``since`` by a consumer that was killed then.

    Returns ``("lapsed", t)`` when its lease lapsed (reclaimed) and the request was claimed
    again at server time ``t``; ``("lapsed", None)`` when reclaimed but not claimed again
    (yet, or dead-lettered); ``("owner", None)`` when the token ended it itself (acked,
    parked, released: it was not the killed consumer's); ``("open", None)`` when nothing
    happened yet.
    """
    reclaimed = False
    for ev in events:
        if ev.time < since - 0.001:
            continue
        if not reclaimed:
            if ev.kind == "reclaim":
                reclaimed = True
            elif ev.kind in ("ack", "park", "release") and ev.token == token:
                return "owner", None
            elif ev.kind == "claim" and ev.token != token:
                # Claimed anew without a reclaim seen: its lapse fell in a MONITOR gap.
                return "lapsed", ev.time
        elif ev.kind == "claim":
            return "lapsed", ev.time
        elif ev.kind == "record":
            # Reclaimed, then recorded without a claim in between: dead-lettered
            # (max_deliveries reached) with its record, pushed by the reclaim (standalone)
            # or from the outbox on the result list's node (cluster).
            return "dead", ev.time
    return ("lapsed", None) if reclaimed else ("open", None)


def order_violations(calls: list[ClaimCall]) -> list[str]:
    """Poll batches whose candidates are not in deadline order (SPEC §3.1: EDF)."""
    bad = []
    for call in calls:
        deadlines = [d for _, _, d in call.candidates]
        if any(a > b for a, b in itertools.pairwise(deadlines)):
            bad.append(f"claim call at {call.time:.6f} from {call.client}: deadlines {deadlines}")
    return bad


def gateway_inversions(
    calls: list[ClaimCall], first_arrival: dict[str, int], deadlines: dict[str, float]
) -> tuple[int, int]:
    """Pairs of one poll batch, both dispatched for the first time, with different deadlines,
    and how many of them reached the gateway in the opposite order (informational: the
    gateway's arrival order across connections is not a total order)."""
    pairs = inverted = 0
    first_claimed: set[str] = set()
    for call in calls:
        fresh = [rid for rid in call.claimed if rid not in first_claimed]
        first_claimed.update(call.claimed)
        fresh = [rid for rid in fresh if rid in first_arrival and rid in deadlines]
        for i, a in enumerate(fresh):
            for b in fresh[i + 1 :]:
                if deadlines[a] == deadlines[b]:
                    continue
                pairs += 1
                early, late = (a, b) if deadlines[a] < deadlines[b] else (b, a)
                if first_arrival[late] < first_arrival[early]:
                    inverted += 1
    return pairs, inverted


def count_records(records: list[bytes]) -> Counter[str]:
    out: Counter[str] = Counter()
    for raw in records:
        try:
            out[json.loads(raw)["id"]] += 1
        except (ValueError, KeyError, TypeError):
            out["<unreadable record>"] += 1
    return out
