"""The Lua script registry (``claimkit/store/scripts.py``) and its contract with the callers.

- Scripts load from the installed package (``claimkit/lua``, what the wheel ships) and,
  without an install, from the source tree's top-level ``lua/``.
- ``-- @include`` lines are resolved; include errors are one clear :class:`ScriptError`.
- Each script's ``numkeys`` (from its file name) equals the ``KEYS[i]`` its header documents,
  the ``KEYS[i]`` its body uses, and the keys :class:`QueueOps` passes (checked by running
  every operation against Redis through a recording store); the store refuses a wrong count.
- ``sha1`` is what Redis calls the script; a ``SCRIPT FLUSH`` costs one EVAL, never an error.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import re
import shutil
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio
from support import StoreWrapper, member, server_now

from claimkit.protocol.consumers import ConsumerIdentity, read_registry
from claimkit.protocol.models import Envelope, Invalid, TerminalRecord, parse_member
from claimkit.protocol.ops import AckItem, QueueOps, move_retries
from claimkit.store import Arg, ScriptCall, Store, StoreError, open_store
from claimkit.store import scripts as _scripts
from claimkit.store.scripts import SHEBANG, Script, ScriptError, all_scripts, script

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from conftest import RedisFactory

SOURCE_LUA = Path(__file__).resolve().parent.parent / "lua"
"""The source tree's ``lua/`` (tests run from a checkout)."""

PROTOCOL_SCRIPTS = {
    # The scripts QueueOps calls (SPEC §3); other modules may add more.
    "ack": 5,
    "claim": 4,
    "dead-letter": 2,
    "move-retries": 2,
    "park": 4,
    "reclaim": 6,
    "release": 4,
    "renew": 4,
    # The consumer registry (claimkit.protocol.consumers, docs/protocol.md#consumers)
    "register": 2,
    "expire-owners": 3,
    "forget-consumers": 2,
    "consumers": 3,
}
CLUSTER_SCRIPTS = {
    # The scripts QueueOps calls on a Redis Cluster instead (docs/topology.md)
    "ack-local": 9,
    "ack-outbox": 6,
    "dead-letter-outbox": 3,
    "move-retries-queue": 3,
    "outbox-aim": 1,
    "push-result": 3,
    "reclaim-cluster": 7,
}
PRODUCER_SCRIPTS = {
    # The submit scripts (claimkit.protocol.submit): standalone, then the cluster's
    "submit": 1,
    "enqueue": 2,
}
ALL_CALLED = PROTOCOL_SCRIPTS | CLUSTER_SCRIPTS | PRODUCER_SCRIPTS
READ_ONLY_SCRIPTS = {"inspect", "result-inspect", "consumers", "queue-stats"}

Q = "{tenant-a}:requests"
RETRY = "retry-sortedset"


@pytest.fixture
def fresh_registry() -> Iterator[None]:
    """Let a test point the loader somewhere else; the cached registry is rebuilt after."""
    all_scripts.cache_clear()
    yield
    all_scripts.cache_clear()


def copy_lua(to: Path, source: Path = SOURCE_LUA) -> Path:
    to.mkdir(parents=True)
    for path in source.glob("*.lua"):
        shutil.copyfile(path, to / path.name)
    return to


def load_from(monkeypatch: pytest.MonkeyPatch, folder: Path) -> dict[str, Script]:
    monkeypatch.setattr(_scripts, "_lua_dir", lambda: folder)
    all_scripts.cache_clear()
    return all_scripts()


def header(source: str) -> str:
    """The ``--[[ ... ]]`` comment block a script opens with (after its shebang line)."""
    match = re.match(r"(?:#![^\n]*\n)?\s*--\[\[(.*?)\]\]", source, re.DOTALL)
    assert match is not None, "a script opens with a --[[ ... ]] header"
    return match.group(1)


def header_keys(source: str) -> dict[int, str]:
    """``{i: key pattern}`` of every ``KEYS[i]`` line of the header (its last word)."""
    found: dict[int, str] = {}
    for line in header(source).splitlines():
        match = re.match(r"\s*KEYS\[(\d+)\]\s+(.*\S)\s*$", line)
        if match:
            index = int(match.group(1))
            assert index not in found, f"KEYS[{index}] documented twice"
            found[index] = match.group(2).split()[-1]
    return found


# -- loading ---------------------------------------------------------------------------------


def test_every_script_is_loaded_with_its_key_count() -> None:
    scripts = all_scripts()
    assert {n: s.numkeys for n, s in scripts.items() if n in ALL_CALLED} == ALL_CALLED
    on_disk = {p.name for p in _scripts._lua_dir().glob("*.lua") if not p.name.startswith("_")}
    assert {f"{n}-{s.numkeys}.lua" for n, s in scripts.items()} == on_disk
    for name, s in scripts.items():
        assert s.name == name
        assert script(name) is s
    with pytest.raises(KeyError):
        script("no-such-script")


def test_the_loader_prefers_the_packaged_lua_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_registry: None
) -> None:
    # An installed wheel has claimkit/lua/ (pyproject force-include): it must win over ./lua.
    package = tmp_path / "site-packages" / "claimkit"
    packaged = copy_lua(package / "lua")
    marker = "-- packaged copy\n"
    renew = packaged / "renew-4.lua"
    renew.write_text(renew.read_text(encoding="utf-8") + marker, encoding="utf-8")
    monkeypatch.setattr(resources, "files", lambda _name: package)

    assert _scripts._lua_dir() == packaged
    scripts = all_scripts()
    assert set(scripts) >= set(ALL_CALLED)
    assert scripts["renew"].source.endswith(marker)
    assert "-- @include" not in scripts["claim"].source


def test_the_loader_falls_back_to_the_source_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_registry: None
) -> None:
    package = tmp_path / "claimkit"  # a package directory without lua/
    package.mkdir()
    monkeypatch.setattr(resources, "files", lambda _name: package)
    # As if running from the checkout (the installed copy of store/scripts.py has no ../../lua).
    monkeypatch.setattr(
        _scripts, "__file__", str(SOURCE_LUA.parent / "claimkit" / "store" / "scripts.py")
    )
    assert _scripts._lua_dir() == SOURCE_LUA
    scripts = all_scripts()
    assert set(scripts) >= set(ALL_CALLED)
    for name, s in scripts.items():
        assert (SOURCE_LUA / f"{name}-{s.numkeys}.lua").is_file()


def test_no_lua_anywhere_is_a_script_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_registry: None
) -> None:
    package = tmp_path / "pkg" / "claimkit"
    package.mkdir(parents=True)
    monkeypatch.setattr(resources, "files", lambda _name: package)
    monkeypatch.setattr(_scripts, "__file__", str(package / "store" / "scripts.py"))
    with pytest.raises(ScriptError, match="Lua scripts are missing"):
        all_scripts()


def test_the_installed_distribution_ships_the_scripts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_registry: None
) -> None:
    real_lua_dir = _scripts._lua_dir
    try:
        dist = importlib.metadata.distribution("claimkit")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("claimkit is not installed (plain source checkout)")
    shipped = {
        Path(str(f)).name: Path(str(dist.locate_file(f)))
        for f in dist.files or []
        if str(f).replace("\\", "/").startswith("claimkit/lua/") and str(f).endswith(".lua")
    }
    assert shipped, "the wheel ships claimkit/lua/*.lua (pyproject force-include)"
    # What the wheel installed loads on its own: its includes travel with it. (An editable
    # install keeps a snapshot taken at install time, so only the protocol scripts are
    # required here; the active folder is compared with the checkout below.)
    folder = tmp_path / "installed-lua"
    folder.mkdir()
    for name, path in shipped.items():
        shutil.copyfile(path, folder / name)
    scripts = load_from(monkeypatch, folder)
    assert {n: s.numkeys for n, s in scripts.items() if n in ALL_CALLED} == ALL_CALLED
    for s in scripts.values():
        assert "@include" not in s.source
    packaged = resources.files("claimkit") / "lua"
    if packaged.is_dir():  # a real (non-editable) install: the loader must use its copy
        assert real_lua_dir() == Path(str(packaged))


def test_the_active_lua_dir_matches_the_source_tree() -> None:
    # Whichever folder the loader uses (the wheel's copy or ./lua) holds the same scripts as
    # the checkout these tests belong to: a stale wheel would run old Lua.
    active = _scripts._lua_dir()
    for path in SOURCE_LUA.glob("*.lua"):
        assert (active / path.name).read_bytes() == path.read_bytes(), path.name
    assert {p.name for p in active.glob("*.lua")} == {p.name for p in SOURCE_LUA.glob("*.lua")}


# -- includes --------------------------------------------------------------------------------


_INCLUDE_LINE = re.compile(r"^-- @include _[a-z-]+\s*$", re.MULTILINE)


def _first_function(text: str) -> str:
    found = re.search(r"^local function (\w+)\(", text, re.MULTILINE)
    assert found is not None
    return found.group(1)


def test_every_script_starts_with_the_shebang() -> None:
    # The shebang makes a cluster node enforce the declared-key, one-slot rule; it is the
    # first line of what Redis runs, and nothing else is added to the file's text. Only the
    # read-only scripts carry a flag (no-writes: they run while Redis is over maxmemory).
    for s in all_scripts().values():
        shebang = "#!lua flags=no-writes\n" if s.name in READ_ONLY_SCRIPTS else SHEBANG
        assert s.source.startswith(shebang), s.name
        assert s.source.count("#!") == 1, s.name
        assert ("-- @flags no-writes" in s.source) == (s.name in READ_ONLY_SCRIPTS)
        assert s.sha1 == hashlib.sha1(s.source.encode(), usedforsecurity=False).hexdigest()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("-- @flags no-writes\n-- @flags allow-oom\nreturn 1\n", "more than one"),
        ("-- @flags no-wrongs\nreturn 1\n", "unknown script flag 'no-wrongs'"),
    ],
)
def test_bad_flags_lines_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_registry: None, text: str, message: str
) -> None:
    folder = tmp_path / "lua"
    folder.mkdir()
    (folder / "thing-1.lua").write_text(text, encoding="utf-8")
    with pytest.raises(ScriptError, match=message):
        load_from(monkeypatch, folder)


async def test_a_read_only_script_runs_over_maxmemory(redis_factory: RedisFactory) -> None:
    """The no-writes flag keeps ``claimkit inspect`` working on a Redis over its memory
    limit, as before the shebang; a flagless script is refused there before it runs."""
    server = redis_factory(extra_args=["--maxmemory-policy", "noeviction"])
    with trio.fail_after(30):
        async with open_store(server.url) as st:
            await st.command("SET", "filler", "x" * 2_000_000)
            await st.command("CONFIG", "SET", "maxmemory", "1mb")
            keys = ["q", "q:claimed", "q:claim-owners", "q:claims-idx", "q:deliveries", "q:dead"]
            reply = await st.run(script("inspect"), keys, [0, 0])
            assert reply[1:3] == [0, None]
            # The queue-wide gauges stay readable too (docs/metrics.md#queue-wide-gauges).
            stats = ["q", "q:claim-owners", "q:claims-idx", "q:dead", "r", "r:dead", "q:consumers"]
            reply = await st.run(script("queue-stats"), stats, [16])
            assert reply[1:4] == [0, 0, 0]
            with pytest.raises(StoreError, match="OOM"):
                await st.run(script("move-retries"), ["r", "r:dead"], [1])


async def test_a_shebang_script_on_standalone_runs_as_before(store: Store) -> None:
    """Redis 7 runs a flagless shebang script on a standalone server as it did without the
    line: undeclared keys stay reachable and a script error keeps the writes before it (so
    the guards still matter); error line numbers count the shebang as line 1."""
    body = "redis.call('SET', KEYS[1], 'a')\nredis.call('SET', 'undeclared', 'b')\nerror('x')"
    with trio.fail_after(10):
        with pytest.raises(StoreError, match=r"user_script:4:"):
            await store.command("EVAL", SHEBANG + body, 1, "declared")
        assert await store.command("MGET", "declared", "undeclared") == [b"a", b"b"]


def test_includes_are_resolved() -> None:
    includes = {p.stem: p.read_text(encoding="utf-8") for p in _scripts._lua_dir().glob("_*.lua")}
    assert set(includes) == {
        "_checks",
        "_drop-claim",
        "_enqueue",
        "_guard-keys",
        "_lease",
        "_live-copy",
        "_liveness",
        "_member",
        "_push-terminal",
        "_queue-score",
        "_record",
        "_server-now",
        "_dedup",
        "_markers",
        "_move-retries",
        "_outbox",
        "_reclaim",
        "_result-clock",
    }
    for s in all_scripts().values():
        assert "@include" not in s.source, s.name
        raw = (_scripts._lua_dir() / f"{s.name}-{s.numkeys}.lua").read_text(encoding="utf-8")
        for name in re.findall(r"^-- @include (_[a-z-]+)\s*$", raw, re.MULTILINE):
            # An include naming includes of its own has them pasted where it names them
            # (or above, once per script): each piece between those lines is in the source.
            for piece in _INCLUDE_LINE.split(includes[name]):
                assert piece.strip() in s.source, f"{s.name} lacks {name}"
            assert s.source.count(f"local function {_first_function(includes[name])}(") == 1
        # Every helper a script calls is defined in its resolved source.
        for helper in (
            "server_now",
            "fmt_time",
            "push_terminal",
            "drop_claim",
            "guard_keys",
            "count_arg",
            "number_arg",
            "list_usable",
            "claim_score",
            "next_delivery",
            "lease_expiry",
            "guarded_get",
            "decode_member",
            "member_deadline",
            "member_id",
            "member_internal",
            "json_string",
            "error_record",
            "is_duplicate",
            "markers_usable",
            "marker_get",
            "push_marked",
            "sweep_markers",
            "move_due_retries",
            "reclaim_pass",
            "queue_score",
            "format_score",
            "whole_number",
            "member_queue_score",
            "counter_problem",
            "enqueue",
        ):
            if re.search(rf"\b{helper}\(", s.source):
                assert f"local function {helper}(" in s.source, f"{s.name}: {helper}"


WRITING_SCRIPTS = {
    # script: the types its KEYS must have, in order (their headers say the same)
    "ack": ["zset", "hash", "hash", "zset", "hash"],
    "claim": ["zset", "hash", "hash", "zset"],
    "dead-letter": ["zset", "zset"],
    "drop-markers": ["hash", "zset"],
    "move-retries": ["zset", "zset"],
    "park": ["hash", "hash", "zset", "zset"],
    "reclaim": ["zset", "hash", "hash", "zset", "hash", "zset"],
    "release": ["zset", "hash", "hash", "zset"],
    "renew": ["hash", "zset", "zset", "hash"],
    "register": ["zset", "hash"],
    "expire-owners": ["hash", "zset", "zset"],
    "forget-consumers": ["zset", "hash"],
    "requeue-dead": ["zset", "zset", "hash"],
    "ack-local": ["zset", "hash", "hash", "zset", "hash", "hash", "list", "hash", "zset"],
    "ack-outbox": ["zset", "hash", "hash", "zset", "hash", "hash"],
    "dead-letter-outbox": ["zset", "zset", "hash"],
    "move-retries-queue": ["zset", "zset", "zset"],
    "outbox-aim": ["hash"],
    "push-result": ["list", "hash", "zset"],
    "reclaim-cluster": ["zset", "hash", "hash", "zset", "hash", "zset", "hash"],
    "result-receive": ["list", "hash", "hash", "zset", "zset"],
    "result-renew": ["hash", "zset"],
    "result-ack": ["hash", "hash", "zset", "zset"],
    "result-pop": ["list", "hash", "hash", "zset", "zset"],
    "submit": ["zset"],
    "enqueue": ["zset", "string"],
}
GUARDED_FIRST = {"ack-local": 6, "push-result": 0, "enqueue": 1}
"""Scripts whose first statement guards only their first N keys: the others (a result list
and its dedup markers) are type-checked before the first write too, but a key of another
type there sends the records elsewhere instead of failing the call, unless the list is the
last resort (then it fails with WRONGTYPE: the test below passes that flag). The enqueue
counter is checked before the first write too, and a key of another type is refused with a
reply that names it (tests/test_enqueue_order.py)."""


def test_every_writing_script_guards_its_keys_before_writing() -> None:
    """A script keeps the writes made before it fails; each one that writes checks every
    KEYS type first, in the order its header gives."""
    scripts = all_scripts()
    assert set(WRITING_SCRIPTS) == set(scripts) - READ_ONLY_SCRIPTS
    for name, kinds in WRITING_SCRIPTS.items():
        source = scripts[name].source
        guarded = kinds[: GUARDED_FIRST.get(name, len(kinds))]
        call = "guard_keys(" + ", ".join(f"'{k}'" for k in kinds) + ")"
        if name in GUARDED_FIRST:
            if guarded:
                call = "guard_keys(" + ", ".join(f"'{k}'" for k in guarded) + ")"
            else:  # the types are read first, then guarded when the list is the last resort
                assert "guard_keys(" + ", ".join(f"'{k}'" for k in kinds) + ")" in source
                call = "local dedup_ttl = count_arg(1, 0)"
        assert call in source, name
        # The guard is the script's first statement: before it, only included functions.
        first = re.sub(
            r"\A\s*--\[\[.*?\]\]", "", source.removeprefix(SHEBANG), count=1, flags=re.DOTALL
        )
        top = [line for line in first.splitlines() if line and not line.startswith((" ", "--"))]
        # (An include's constant table, ``local NAME = {`` ... ``}``, is no statement either.)
        statements = [
            line
            for line in top
            if not line.startswith(("local function", "end", "}"))
            and not re.match(r"local [A-Z_]+ = ", line)
        ]
        assert statements[0] == call, (name, statements[:2])
        header = source.split("]]", 1)[0].upper()
        for i, kind in enumerate(kinds, start=1):
            assert re.search(rf"KEYS\[{i}\] .*\b{kind.upper()}\b", header), (name, i, kind)


@pytest.mark.parametrize("script_name", sorted(WRITING_SCRIPTS))
async def test_a_key_of_another_type_fails_the_script_before_any_write(
    store: Store, script_name: str
) -> None:
    """Every key of every writing script in turn holds a string: the script fails with
    WRONGTYPE and the keyspace is exactly as before."""
    scripts = all_scripts()
    s = scripts[script_name]
    keys = [f"g{i}" for i in range(1, s.numkeys + 1)]
    for i in range(s.numkeys):
        if WRITING_SCRIPTS[script_name][i] == "string":
            continue  # a counter: a string is its own type (refusals: test_enqueue_order.py)
        await store.command("FLUSHDB")
        await store.command("SET", keys[i], "not-a-" + WRITING_SCRIPTS[script_name][i])
        before = await store.command("KEYS", "*")
        with pytest.raises(StoreError, match="wrong kind of value"):
            await store.run(s, keys, GUARD_ARGV[script_name])
        assert await store.command("KEYS", "*") == before
        assert (
            await store.command("GET", keys[i])
            == ("not-a-" + WRITING_SCRIPTS[script_name][i]).encode()
        )


# ARGV that would make each script write something if its keys were fine.
GUARD_ARGV: dict[str, list[Arg]] = {
    "ack": [0, "fallback", "a", "t", "", "result-terminal:a", "rl", "{}", "m"],
    "claim": [60, "request-cancel:", "m", "a", "t", 4102444800, ""],
    "dead-letter": [0, "fallback", "m", "a", "", "result-terminal:a", "rl", "{}"],
    "drop-markers": ["a", "1"],
    "move-retries": [100],
    "park": ["a", "t", 1, "m"],
    "reclaim": [100, 10, "", "rl", "result-terminal:", 0],
    "release": ["a", "t", ""],
    "renew": [60, "c", 10, "h", 1, "v", "a", "t", 4102444800],
    "register": ["c", 10, "h", 1, "v"],
    "expire-owners": ["0", 100, "any"],
    "forget-consumers": ["dead"],
    "requeue-dead": ["result-terminal:", "0", "m", "a"],
    "ack-local": [0, "1", "fb", "a", "t", "", "{}", "m", "a\x00t"],
    "ack-outbox": ["a", "t", "", "rl", "{}", "m", "a\x00t"],
    "dead-letter-outbox": ["m", "", "a", "a\x00t", "rl", "{}"],
    "move-retries-queue": [100],
    "outbox-aim": ["a\x00t", "{}"],
    "push-result": [0, "1", "a", "", "{}"],
    "reclaim-cluster": [100, 10, "", "rl", "", 0],
    "result-receive": ["o", 1000, 100, 100, 100],
    "result-renew": ["a", "o", 1000],
    "result-ack": ["a", "o", 1000, 100],
    "result-pop": [1],
    "submit": ["c", 4102448400, "x", "y", "t", 4102444800000, "", "", "", "{", "}", 4102444800],
    "enqueue": [4102448400, 4102444800, "{", "}"],
}


def test_nested_includes_resolve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_registry: None
) -> None:
    folder = tmp_path / "lua"
    folder.mkdir()
    (folder / "_inner.lua").write_text("local inner = 1\n", encoding="utf-8")
    (folder / "_outer.lua").write_text(
        "-- @include _inner\nlocal outer = inner\n", encoding="utf-8"
    )
    (folder / "thing-1.lua").write_text("-- @include _outer\nreturn outer\n", encoding="utf-8")
    scripts = load_from(monkeypatch, folder)
    assert list(scripts) == ["thing"]
    thing = scripts["thing"]
    assert (thing.name, thing.numkeys) == ("thing", 1)
    lines = [line for line in thing.source.splitlines() if line.strip()]
    assert lines == ["#!lua", "local inner = 1", "local outer = inner", "return outer"]
    assert thing.sha1 == hashlib.sha1(thing.source.encode()).hexdigest()


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"thing-1.lua": "-- @include _missing\n"}, r"_missing\.lua does not exist"),
        (
            {
                "thing-1.lua": "-- @include _a\n",
                "_a.lua": "-- @include _b\n",
                "_b.lua": "-- @include _a\n",
            },
            "include cycle through _a",
        ),
        ({"Thing.lua": "return 1\n"}, "named <verb>-<numkeys>.lua"),
        ({"thing.lua": "return 1\n"}, "named <verb>-<numkeys>.lua"),
    ],
)
def test_broken_lua_folders_are_script_errors(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fresh_registry: None,
    files: dict[str, str],
    message: str,
) -> None:
    folder = tmp_path / "lua"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    with pytest.raises(ScriptError, match=message):
        load_from(monkeypatch, folder)


# -- key counts: file name, header, body, caller -----------------------------------------------


@pytest.mark.parametrize("name", sorted(all_scripts()))
def test_header_documents_exactly_numkeys_keys(name: str) -> None:
    s = script(name)
    documented = header_keys(s.source)
    assert sorted(documented) == list(range(1, s.numkeys + 1))
    body = re.sub(r"\A\s*--\[\[.*?\]\]", "", s.source.split("\n", 1)[1], count=1, flags=re.DOTALL)
    code = re.sub(r"--[^\n]*", "", body)  # includes' comments name KEYS[i] in general
    used = {int(i) for i in re.findall(r"KEYS\[(\d+)\]", code)}
    assert used == set(range(1, s.numkeys + 1)), f"{name} body uses KEYS{sorted(used)}"
    # The header also documents its ARGV and its output.
    assert "ARGV[" in header(s.source) or "then " in header(s.source)
    assert "Output:" in header(s.source)


class RecordingStore(StoreWrapper):
    """A store that records every script call and delegates to a real one."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.runs: list[tuple[str, list[str]]] = []

    async def run(self, s: Script, keys: Sequence[str], args: Sequence[Arg]) -> Any:
        self.runs.append((s.name, list(keys)))
        return await self.inner.run(s, keys, args)

    async def run_many(self, s: Script, calls: Sequence[ScriptCall]) -> list[Any]:
        self.runs += [(s.name, list(keys)) for keys, _ in calls]
        return await self.inner.run_many(s, calls)


async def test_queue_ops_pass_the_documented_keys(store: Store) -> None:
    with trio.fail_after(10):
        rec = RecordingStore(store)
        ops = QueueOps(rec, Q, consumer=ConsumerIdentity("c", 10, "h", 1, "v"))
        now = await server_now(store)
        deadline = int(now) + 600
        raw = member("a", deadline, request_token="ab" * 16)
        await store.command("ZADD", Q, deadline, raw)
        env = parse_member(raw)
        bad = parse_member(b"not json")
        assert isinstance(env, Envelope)
        assert isinstance(bad, Invalid)

        await ops.dead_letter([bad])
        _, codes = await ops.claim([(env, "t1")], 60)
        assert codes == [1]
        await ops.renew([("a", "t1", deadline)], 60)
        await ops.park([("a", "t1", 1.0, raw)])
        await ops.release([("a", "t1", None)])
        record = TerminalRecord.error("a", "CANCELLED", "cancelled").to_json()
        await ops.ack([AckItem("a", "t1", "", "result-list", record, raw)])
        await ops.reclaim(max_deliveries=10)
        await move_retries(rec, RETRY)
        await ops.register()
        await store.command("ZADD", ops.keys.consumers, 1000, "c")
        await ops.expire_owners()
        await read_registry(rec, ops.keys)
        await ops.forget_self()

        called = {name for name, _ in rec.runs}
        assert called == set(PROTOCOL_SCRIPTS), "every script is exercised"
        for name, keys in rec.runs:
            s = script(name)
            assert len(keys) == s.numkeys, name
            expected = [
                pattern.replace("<q>", Q) for _, pattern in sorted(header_keys(s.source).items())
            ]
            assert keys == expected, name


@pytest.mark.parametrize("name", sorted(all_scripts()))
async def test_the_store_refuses_a_wrong_key_count(store: Store, name: str) -> None:
    with trio.fail_after(10):
        s = script(name)
        await store.command("SET", "canary", "1")
        for count in (0, s.numkeys - 1, s.numkeys + 1):
            if count == s.numkeys:
                continue
            keys = [f"k{i}" for i in range(count)]
            with pytest.raises(ValueError, match=f"{name} takes {s.numkeys} keys, got {count}"):
                await store.run(s, keys, ["1"])
        # Nothing reached Redis.
        assert await store.command("KEYS", "*") == [b"canary"]


def test_only_the_protocol_layer_imports_the_script_registry() -> None:
    """One door to the scripts: outside ``claimkit.store`` itself, only ``claimkit.protocol``
    imports ``claimkit.store.scripts`` (the same rule as the import-linter contract)."""
    package = Path(_scripts.__file__).resolve().parents[1]
    importers = set()
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if "claimkit.store.scripts" in names:
                importers.add(path.relative_to(package).parts[0])
    assert importers <= {"protocol", "store"}
    assert "protocol" in importers


def test_the_request_token_has_one_name() -> None:
    """``internal.request_token`` is ``request_token`` in Python and in every script."""
    for s in all_scripts().values():
        assert "gen_token" not in s.source, s.name


def test_a_script_checks_its_key_count() -> None:
    s = script("claim")
    s.check_key_count(["a", "b", "c", "d"])
    with pytest.raises(ValueError, match=r"^claim takes 4 keys, got 3$"):
        s.check_key_count(["a", "b", "c"])


# -- SHA1 and NOSCRIPT ---------------------------------------------------------------------------


async def test_sha1_matches_script_load(store: Store) -> None:
    with trio.fail_after(10):
        for s in all_scripts().values():
            assert s.sha1 == hashlib.sha1(s.source.encode("utf-8")).hexdigest()
            assert await store.command("SCRIPT", "LOAD", s.source) == s.sha1.encode()
        shas = [s.sha1 for s in all_scripts().values()]
        assert await store.command("SCRIPT", "EXISTS", *shas) == [1] * len(shas)


def _commandstats(info: bytes) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for line in info.decode().splitlines():
        if line.startswith("cmdstat_"):
            name, _, fields = line.partition(":")
            out[name.removeprefix("cmdstat_")] = {
                k: int(float(v)) for k, v in (f.split("=") for f in fields.split(","))
            }
    return out


async def test_noscript_falls_back_to_eval_once(store: Store) -> None:
    with trio.fail_after(10):
        ops = QueueOps(store, Q)
        renew = script("renew")
        await store.command("SCRIPT", "FLUSH")
        await store.command("CONFIG", "RESETSTAT")
        assert await store.command("SCRIPT", "EXISTS", renew.sha1) == [0]

        _, codes = await ops.renew([("gone", "t", 1)], 5)
        assert codes == [0]
        stats = _commandstats(await store.command("INFO", "commandstats"))
        assert stats["evalsha"]["calls"] == 1
        assert stats["evalsha"]["failed_calls"] == 1  # NOSCRIPT
        assert stats["eval"]["calls"] == 1
        assert await store.command("SCRIPT", "EXISTS", renew.sha1) == [1]

        _, codes = await ops.renew([("gone", "t", 1)], 5)
        assert codes == [0]
        stats = _commandstats(await store.command("INFO", "commandstats"))
        assert stats["evalsha"] == stats["evalsha"] | {"calls": 2, "failed_calls": 1}
        assert stats["eval"]["calls"] == 1  # loaded now: EVALSHA alone
        assert await store.command("KEYS", "*") == []


# -- one record serialiser (lua/_record.lua) -------------------------------------------------

RECORD_TEXTS = [
    "plain",
    "a/b//c",
    'q"uote',
    "back\\slash\\/",
    "é ü 中 😀",
    "tab\tnl\nret\rff\fbs\bctl\x01\x1f",
    "del\x7f",
    "nul\x00byte",
    "line\u2028sep\u2029par",
    "<b>&</b>",
    "a\u2027b\u202ac\ufffd",
    "",
]
RECORD_TOKEN = "0123456789abcdef0123456789abcdef"


def _record_probe() -> Script:
    source = _scripts._resolve(
        "-- @include _record\nreturn error_record(ARGV[1], ARGV[2], ARGV[3], ARGV[4])",
        _scripts._lua_dir(),
        set(),
    )
    return Script("record", 0, source, hashlib.sha1(source.encode()).hexdigest())


@pytest.mark.parametrize("token", ["", RECORD_TOKEN])
@pytest.mark.parametrize("text", RECORD_TEXTS)
async def test_the_lua_record_is_byte_for_byte_the_python_one(
    store: Store, text: str, token: str
) -> None:
    """``error_record`` (``lua/_record.lua``, what ``reclaim-6.lua`` pushes) writes exactly
    the bytes :meth:`TerminalRecord.to_json` writes (Go's escaping, ``request_token``
    last, left out when empty), for odd ids and messages alike."""
    message = f"lease expired 3 times {text} (max_deliveries=3)"
    rid = text or "x"
    with trio.fail_after(10):
        got = await store.run(_record_probe(), [], [rid, "MAX_DELIVERIES_EXCEEDED", message, token])
    assert got == TerminalRecord.error(rid, "MAX_DELIVERIES_EXCEEDED", message, token).to_json()


async def test_the_lua_record_of_upstreams_literal_bytes(store: Store) -> None:
    """The bytes llm-d-async's Go writes for an error record with a token and a message
    holding HTML characters, built by the script."""
    with trio.fail_after(10):
        got = await store.run(_record_probe(), [], ["p1", "X", "a<b>&c", RECORD_TOKEN])
    assert got == (
        b'{"id":"p1","payload":"{\\"error\\":\\"a\\\\u003cb\\\\u003e\\\\u0026c\\"}",'
        b'"error_code":"X","error_message":"a\\u003cb\\u003e\\u0026c",'
        b'"request_token":"0123456789abcdef0123456789abcdef"}'
    )


@pytest.mark.parametrize(
    "raw",
    [
        b"\xff",
        b"a\xc0\x80b",  # overlong
        b"\xed\xa0\x80",  # a surrogate, UTF-8 encoded
        b"\xe2\x80",  # cut short
        b"\xe2\x80A",
        b"\xf4\x90\x80\x80",  # above U+10FFFF
        b"\xf0\x9f\x98",  # cut short
        b"ok \xc3\xa9 \xf0\x9f\x98\x80",
    ],
)
async def test_the_lua_record_writes_each_byte_that_is_not_utf8_as_fffd(
    store: Store, raw: bytes
) -> None:
    """Go writes each byte that starts no valid UTF-8 sequence as ``\\ufffd``. The Python
    serialiser never sees such bytes (its text is decoded); decoding them with
    ``surrogateescape`` (one lone surrogate per such byte, which ``to_json`` writes as
    ``\\ufffd``) gives the bytes Go and the script write."""
    with trio.fail_after(10):
        got = await store.run(_record_probe(), [], [raw, "X", "m", ""])
    rid = raw.decode("utf-8", "surrogateescape")
    assert got == TerminalRecord.error(rid, "X", "m").to_json()
