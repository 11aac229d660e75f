"""Result routing: which list a request's terminal record goes to
(docs/protocol.md#result-routing), the one copy of the rule.

The rule: the queue config's ``result_queue_name``, else the member's
``internal.result_queue_name``, else the global ``result_queue_name``. The consumer, the
operator commands and the scripts all take it from :class:`ResultRouting`: Python asks
:meth:`ResultRouting.list_for`, and a script that finds its requests inside Redis
(``lua/reclaim-6.lua``) is handed :meth:`ResultRouting.lua_args` and reads the member's
field only when the first of them is ``""``.
"""

from __future__ import annotations

from dataclasses import dataclass

from claimkit.protocol import keys as _keys

__all__ = ["ResultRouting", "reserved_destination"]


@dataclass(frozen=True, slots=True)
class ResultRouting:
    """Where one queue's terminal records go.

    Args:
        queue_list: the queue config's ``result_queue_name``; ``None`` or ``""`` (unset:
            each member's own ``internal.result_queue_name`` decides).
        default_list: the global ``result_queue_name`` (default ``result-list``).
    """

    queue_list: str | None = None
    default_list: str = _keys.DEFAULT_RESULT_LIST

    def __post_init__(self) -> None:
        if not self.queue_list:
            object.__setattr__(self, "queue_list", None)

    def list_for(self, member_list: str | None) -> str:
        """The list a record goes to, given the member's ``internal.result_queue_name``
        (``None`` or ``""`` when it names none)."""
        return self.queue_list or member_list or self.default_list

    def member_list(self, member_list: str | None) -> str | None:
        """The member's ``internal.result_queue_name`` when it decides the destination (no
        queue list is configured and it names one), else ``None``. A name that decides must
        not be a key claimkit keeps for something else
        (:func:`claimkit.protocol.keys.is_reserved`)."""
        if self.queue_list is not None:
            return None
        return member_list or None

    @property
    def fallback(self) -> str:
        """Where a record goes when the list a member names holds another type of key (the
        scripts check that as they push), and the list a queue's records go to by config
        alone (``claimkit inspect`` counts it): the queue's list, else the global one."""
        return self.queue_list or self.default_list

    def lua_args(self) -> tuple[str, str]:
        """The rule as two script arguments: ``(queue list or "", global list)``. A script
        sends a record to the first when it is not ``""``, else to the member's
        ``internal.result_queue_name`` when that is a non-empty string, else to the second
        (``lua/reclaim-6.lua``, ARGV[3] and ARGV[4])."""
        return self.queue_list or "", self.default_list


def reserved_destination(
    member_list: str | None, reserved: frozenset[str], *, cluster: bool = False
) -> str | None:
    """Why a request may not be served when the list its record would go to is one of
    claimkit's own keys (:func:`~claimkit.protocol.keys.reserved_keys`), else ``None``.

    ``member_list`` is the member's ``internal.result_queue_name`` when it decides the
    destination (:meth:`ResultRouting.member_list`), else ``None``. Pushing a record onto
    such a key would re-create an emptied queue key as a list and break it for every
    request (docs/protocol.md#terminal-record), so the consumer dead-letters the request
    with this ``INVALID_REQUEST`` message, and ``claimkit dead`` gives it as the cause.
    With ``cluster``, so is a list name whose dedup marker keys could not share its slot
    (:func:`~claimkit.protocol.keys.cluster_name_problem`).
    """
    if member_list is None:
        return None
    if _keys.is_reserved(member_list, reserved):
        return f"Failed: internal.result_queue_name names a key claimkit uses: {member_list!r}"
    problem = _keys.cluster_name_problem(member_list) if cluster else None
    return None if problem is None else f"Failed: internal.result_queue_name {problem}"
