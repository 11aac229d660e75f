"""Which Redis type each key ``serve`` uses must hold, and the check of it.

The consumer refuses to start (``serve``'s preflight) and stops (a WRONGTYPE refusal while
running) when a key it uses holds another type than docs/protocol.md#keys gives it: every
lease would run the same requests again and fail the same way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from claimkit.config import ConfigError, WrongKeyType
from claimkit.consumer.gates import budget_key
from claimkit.protocol import keys as _keys

if TYPE_CHECKING:
    from claimkit.config import Config

__all__ = ["KeyRole", "WrongTypeProbe", "check_key_roles", "key_roles"]

WrongTypeProbe = Callable[[Mapping[str, str]], Awaitable["tuple[str, str, str] | None"]]
"""``(key -> TYPE name) -> first (key, found, expected) or None``:
:func:`claimkit.protocol.ops.first_wrong_type` bound to a store, or
:meth:`QueueOps.first_wrong_type <claimkit.protocol.ops.QueueOps.first_wrong_type>`."""


@dataclass(frozen=True, slots=True)
class KeyRole:
    """What a key is to ``serve``: its Redis ``TYPE`` name (docs/protocol.md#keys) and a
    description for one-line errors, with ``{}`` where the key's name goes
    (``"result list {} of queue 'q'"``)."""

    kind: str
    what: str

    def name(self, key: str) -> str:
        return self.what.format(repr(key))


def _marker_roles(result_list: str, want: Callable[[str, str, str], None]) -> None:
    """The dedup marker keys of ``result_list`` in cluster mode, through ``want``."""
    for marker, kind, what in _keys.ResultKeys.for_list(result_list).described()[1:]:
        want(marker, kind, f"{what} {{}} of result list {result_list!r}")


def key_roles(config: Config) -> dict[str, KeyRole]:
    """Every key ``serve`` uses whose Redis type the config tells (docs/protocol.md#keys), by
    name: each queue's own keys (:attr:`~claimkit.protocol.keys.QueueKeys.TYPES`; in cluster
    mode their cluster names, with the queue's outbox and retry sets), the shared retry set
    and its dead set (standalone and sentinel), each queue's result list, the global result
    list (in cluster mode with their dedup marker keys), and a ``redis`` gate's budget key.
    Per-request keys are not among them.

    Raises:
        ConfigError: one name would have to be two types at once (a queue's result list
            named like another queue's dead set, say), as one line.
    """
    roles: dict[str, KeyRole] = {}

    def want(key: str, kind: str, what: str) -> None:
        seen = roles.setdefault(key, KeyRole(kind, what))
        if seen.kind != kind:
            raise ConfigError(
                f"{KeyRole(kind, what).name(key)} is also the {seen.name(key)}: one key "
                f"cannot be both {_keys.type_name(seen.kind)} and {_keys.type_name(kind)}"
            )

    cluster = config.mode == "cluster"  # the cluster layout (docs/topology.md#cluster-key-layout)
    for q in config.queues:
        k = _keys.QueueKeys.for_queue(
            q.queue_name, cluster=cluster, retry_set=config.retry_queue_name
        )
        for name, kind, what in k.described():
            # "queue key 'q'", "claimed hash 'q:claimed' of queue 'q'"
            want(
                name,
                kind,
                f"{what} {{}}" if name == k.pending else f"{what} {{}} of queue {q.queue_name!r}",
            )
    if not cluster:  # a cluster has a retry set per queue, among the queue's keys above
        want(config.retry_queue_name, _keys.RETRY_SET_TYPE, "retry set {}")
        want(_keys.retry_dead(config.retry_queue_name), _keys.RETRY_SET_TYPE, "retry dead set {}")
    for q in config.queues:
        if q.result_queue_name:
            want(
                q.result_queue_name,
                _keys.RESULT_LIST_TYPE,
                f"result list {{}} of queue {q.queue_name!r}",
            )
    want(config.result_queue_name, _keys.RESULT_LIST_TYPE, "global result list {}")
    if cluster:  # each configured list's dedup markers, in its slot
        lists = [q.result_queue_name for q in config.queues if q.result_queue_name]
        for result_list in dict.fromkeys([*lists, config.result_queue_name]):
            _marker_roles(result_list, want)
    for q in config.queues:
        try:
            key = budget_key(q)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if key:
            want(key, _keys.GATE_BUDGET_TYPE, f"gate budget key {{}} of queue {q.queue_name!r}")
    return roles


async def check_key_roles(first_wrong: WrongTypeProbe, roles: Mapping[str, KeyRole]) -> None:
    """Check that every existing key of ``roles`` has its type; a missing key is fine.
    One pipelined round trip of ``TYPE`` calls, made by ``first_wrong``
    (:data:`WrongTypeProbe`).

    Raises:
        WrongKeyType: the first key holding another type, as one line naming the key, what
            it holds and what it should hold.
        StoreUnavailable, StoreError: from the store.
    """
    wrong = await first_wrong({name: role.kind for name, role in roles.items()})
    if wrong is not None:
        name, found, want = wrong
        raise WrongKeyType(
            f"{roles[name].name(name)} holds {_keys.type_name(found)}, not {_keys.type_name(want)}"
        )
