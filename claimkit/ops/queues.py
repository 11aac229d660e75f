"""The queue an operator command works on, resolved against the config (docs/cli.md).

:class:`OperatorQueue` holds a queue name with the configuration it was resolved in and
answers what every operator command asks before it touches Redis: where the queue's
records go, and which Redis type each key it reads must hold. Unrelated to
:class:`claimkit.consumer.dispatch.Target` (where a request is sent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from claimkit.ops.inspect import queue_key_types
from claimkit.protocol import keys as _keys
from claimkit.protocol.routing import ResultRouting

if TYPE_CHECKING:
    from collections.abc import Sequence

    from claimkit.config import Config, QueueConfig
    from claimkit.ops.dead import DeadLetter, DeathCause

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
        qc = self.queue_config
        routing = ResultRouting(qc.result_queue_name if qc else None, self.config.result_queue_name)
        return [routing.fallback]

    def key_types(self) -> dict[str, str]:
        """The Redis type every key the operator commands read must hold, by key name."""
        # The queue's own keys win a name clash: `inspect -q result-list` must say that the
        # key is a list, not a sorted set, rather than check it as the result list.
        types = {self.config.retry_queue_name: _keys.RETRY_SET_TYPE}
        types.update({name: _keys.RESULT_LIST_TYPE for name in self.result_lists})
        types.update(queue_key_types(self.queue))
        return types

    def causes_of_death(
        self, letters: Sequence[DeadLetter], *, configured: bool
    ) -> list[DeathCause]:
        """Why each of ``letters`` died (:meth:`DeadLetter.cause_of_death`), judged with
        this config's reserved keys. Without a transport config (``configured`` false)
        the default max_deliveries would be a guess, so it is not used."""
        config = self.config
        queues = [q.queue_name for q in config.queues] or [self.queue]
        reserved = _keys.reserved_keys(queues, config.retry_queue_name)
        own_list = bool(self.queue_config and self.queue_config.result_queue_name)
        return [
            d.cause_of_death(
                max_deliveries=config.max_deliveries if configured else None,
                reserved=reserved,
                result_list_configured=own_list,
            )
            for d in letters
        ]
