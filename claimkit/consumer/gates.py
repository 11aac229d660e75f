"""Dispatch gates (docs/configuration.md): may this request be dispatched now?

A gate that refuses, or fails, leaves the request pending byte for byte: it is never
claimed (docs/protocol.md). Three kinds, with their ``gate_params`` as llm-d-async writes
them (a string map there, so ``"limit": "4"``; JSON numbers are taken too):

- ``constant``: always open; takes no parameters.
- ``redis``: reads a budget key (``budget_key``, default ``dispatch-gate-budget``; ``key``
  is claimkit's older name for it) holding a number in [0, 1], the fraction of candidates
  to admit; a missing key is 1 (open), 0 closes the gate. Anything else in the key is a
  gate error. The key is read on the queue's own Redis: llm-d-async's ``address``
  (``host:port`` of the Redis holding the key) is accepted when it names that Redis and
  refused when it names another one.
- ``local-max-concurrency``: at most ``limit`` (llm-d-async also wrote
  ``max_concurrency``) requests of this queue in flight in this process.
  ``gating_mode`` (``blocking`` or ``classifying``) is accepted; both behave the same
  here, since a request the gate refuses is not claimed at all: it stays pending.

Unknown parameters are reported by :func:`~claimkit.config.gate_params.check_gate_params`
(the CLI warns about each); a bad value is a one-line ``ValueError`` naming the field. The
parameters are checked in the config layer (:mod:`claimkit.config.gate_params`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from claimkit.config.gate_params import (
    budget_key,
    check_gate_address,
    check_gate_params,
    gate_limit,
    gate_where,
)

if TYPE_CHECKING:
    from claimkit.config import QueueConfig
    from claimkit.store import Store

__all__ = [
    "Gate",
    "GateError",
    "budget_key",  # the config layer's (claimkit.config.gate_params), for the consumer
    "make_gate",
]


class GateError(RuntimeError):
    """The gate could not decide; the candidates stay pending."""


class Gate(Protocol):
    async def admit(self, wanted: int, inflight: int) -> int:
        """How many of ``wanted`` candidates may be claimed now, given ``inflight`` requests
        of this queue in flight here. Raises :class:`GateError`."""
        ...


@dataclass
class ConstantGate:
    async def admit(self, wanted: int, inflight: int) -> int:
        return wanted


@dataclass
class RedisBudgetGate:
    store: Store
    key: str
    rng: random.Random

    async def admit(self, wanted: int, inflight: int) -> int:
        try:
            raw = await self.store.command("GET", self.key)
        except Exception as exc:
            raise GateError(f"cannot read {self.key}: {exc}") from exc
        if raw is None:
            return wanted
        try:
            budget = float(raw)
        except ValueError:
            raise GateError(f"{self.key} holds {raw!r}, not a number in [0, 1]") from None
        if not 0.0 <= budget <= 1.0:
            raise GateError(f"{self.key} holds {budget}, not a number in [0, 1]")
        return sum(1 for _ in range(wanted) if self.rng.random() < budget)


@dataclass
class LocalMaxConcurrencyGate:
    limit: int

    async def admit(self, wanted: int, inflight: int) -> int:
        return max(0, min(wanted, self.limit - inflight))


def make_gate(queue: QueueConfig, store: Store, rng: random.Random | None = None) -> Gate:
    """The gate ``queue.gate_type`` names.

    Raises:
        ValueError: bad ``gate_params`` (see :func:`check_gate_params`), or an ``address``
            naming another Redis than the store's (:func:`check_gate_address`); one line.
    """
    params, where = queue.gate_params, gate_where(queue)
    check_gate_params(queue.gate_type, params, where)
    if queue.gate_type == "redis":
        check_gate_address(params, where, store.url)
        key = budget_key(queue, where)
        assert key is not None
        return RedisBudgetGate(store, key, rng or random.Random())
    if queue.gate_type == "local-max-concurrency":
        return LocalMaxConcurrencyGate(gate_limit(params, where))
    return ConstantGate()
