"""The queue an operator command works on, resolved against the config (docs/cli.md).

:class:`OperatorQueue` holds a queue name with the configuration it was resolved in and
answers what every operator command asks before it touches Redis: where the queue's
records go, and which Redis type each key it reads must hold, in the key layout of the
store's mode (standalone, docs/protocol.md#keys; a Redis Cluster,
docs/topology.md#cluster-key-layout). Unrelated to
:class:`claimkit.consumer.dispatch.Target` (where a request is sent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from claimkit.ops.inspect import cluster_layout, queue_key_types
from claimkit.protocol import keys as _keys
from claimkit.protocol.routing import ResultRouting

if TYPE_CHECKING:
    from collections.abc import Sequence

    from claimkit.config import Config, QueueConfig
    from claimkit.ops.dead import DeadLetter, DeathCause
    from claimkit.store import Store

__all__ = ["OperatorQueue"]


@dataclass(frozen=True, slots=True)
class OperatorQueue:
    """A queue an operator command works on, with where its records go.

    ``queue_config`` is the queue's entry in ``config`` (``None`` when the config lists
    no queues: a bare Redis URL accepts any queue name).
    """

    config: Config
    queue: str
    queue_config: QueueConfig | None

    @property
    def result_lists(self) -> list[str]:
        """The list this queue's records go to by config alone (docs/protocol.md#result-routing):
        :attr:`ResultRouting.fallback <claimkit.protocol.routing.ResultRouting.fallback>`,
        the one routing rule. A member that names its own ``internal.result_queue_name``
        sends its record there instead; those lists are not known without reading every
        member, so the operator commands name them with ``--list``."""
        return [self.routing.fallback]

    @property
    def routing(self) -> ResultRouting:
        """This queue's result routing (docs/protocol.md#result-routing): its configured
        ``result_queue_name``, else the member's, else the global one."""
        qc = self.queue_config
        return ResultRouting(qc.result_queue_name if qc else None, self.config.result_queue_name)

    def key_types(self, store: Store, *, markers: bool = False) -> dict[str, str]:
        """The Redis type every key the operator commands read must hold, by key name, in
        ``store``'s key layout (:func:`~claimkit.ops.inspect.cluster_layout`): the queue's
        keys, the retry set (on a Redis Cluster the queue's own, with its outbox) and
        :attr:`result_lists`. ``markers``: on a Redis Cluster also the dedup marker keys of
        those lists (``{L}:result-terminal``, ``{L}:result-terminal-expiry``; ``dead
        requeue`` deletes markers there)."""
        cluster = cluster_layout(store)
        retry = self.config.retry_queue_name
        # The queue's own keys win a name clash: `inspect -q result-list` must say that the
        # key is a list, not a sorted set, rather than check it as the result list.
        types = {} if cluster else {retry: _keys.RETRY_SET_TYPE}
        for name in self.result_lists:
            if cluster and markers:
                types.update(_keys.ResultKeys.for_list(name).types())
            types[name] = _keys.RESULT_LIST_TYPE
        types.update(queue_key_types(self.queue, cluster=cluster, retry_set=retry))
        return types

    def causes_of_death(
        self, letters: Sequence[DeadLetter], *, configured: bool, cluster: bool = False
    ) -> list[DeathCause]:
        """Why each of ``letters`` died (:meth:`DeadLetter.cause_of_death`), judged with
        this config's reserved keys (in the cluster layout when ``cluster``). Without a
        transport config (``configured`` false) the default max_deliveries would be a
        guess, so it is not used."""
        config = self.config
        queues = [q.queue_name for q in config.queues] or [self.queue]
        reserved = _keys.reserved_keys(queues, config.retry_queue_name, cluster=cluster)
        own_list = bool(self.queue_config and self.queue_config.result_queue_name)
        return [
            d.cause_of_death(
                max_deliveries=config.max_deliveries if configured else None,
                reserved=reserved,
                result_list_configured=own_list,
                cluster=cluster,
            )
            for d in letters
        ]
