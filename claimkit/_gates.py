"""Dispatch gates (SPEC §6): may this request be dispatched now?

A gate that refuses, or fails, leaves the request pending byte for byte: it is never
claimed (SPEC §3.8). Three kinds:

- ``constant``: always open.
- ``redis``: reads a budget key (``gate_params.key``, default ``dispatch-gate-budget``)
  holding a number in [0, 1], the fraction of candidates to admit; a missing key is 1
  (open), 0 closes the gate. Anything else in the key is a gate error.
- ``local-max-concurrency``: at most ``gate_params.limit`` requests of this queue in flight
  in this process.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ._config import QueueConfig
    from ._store import Store

__all__ = ["Gate", "GateError", "make_gate"]

DEFAULT_BUDGET_KEY = "dispatch-gate-budget"


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
    """The gate ``queue.gate_type`` names. Raises ``ValueError`` for bad ``gate_params``."""
    params = queue.gate_params
    if queue.gate_type == "redis":
        key = params.get("key", DEFAULT_BUDGET_KEY)
        if not isinstance(key, str) or not key:
            raise ValueError(
                f"queue {queue.queue_name}: gate_params.key must be a non-empty string"
            )
        return RedisBudgetGate(store, key, rng or random.Random())
    if queue.gate_type == "local-max-concurrency":
        limit = params.get("limit")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(
                f"queue {queue.queue_name}: gate_params.limit must be a positive integer"
            )
        return LocalMaxConcurrencyGate(limit)
    return ConstantGate()
