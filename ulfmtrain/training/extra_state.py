"""The state beyond model and optimizer that survivors keep identical and hand to a replacement: the sampler,
LR schedulers, a GradScaler, any object with state_dict()/load_state_dict()."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class ExtraState:
    """Named (get, set) pairs, and what a replacement received before the object was registered."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.entries: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self.pending: dict[str, Any] = {}
        # The wrapped optimizer's state as received: a scheduler's constructor writes the learning rates again.
        self.received_optimizer: dict[str, Any] | None = None

    def register(self, name: str, get: Callable[[], Any], set: Callable[[Any], None]) -> None:
        self.entries[name] = (get, set)
        if name in self.pending:       # a replacement that received the state before this object existed
            set(self.pending.pop(name))
            if self.received_optimizer is not None:
                self.optimizer.load_state_dict(self.received_optimizer)

    def get(self) -> dict[str, Any]:
        return {k: get() for k, (get, _) in self.entries.items()}

    def load(self, extra: dict[str, Any], optimizer_state: dict[str, Any]) -> None:
        for k, v in extra.items():
            if k in self.entries:
                self.entries[k][1](v)
            else:                     # registered later: register() loads it then
                self.pending[k] = v
        if extra:
            self.received_optimizer = optimizer_state

    def forget_received(self) -> None:
        """Once a step committed, what was received is history: an object registered later keeps its state."""
        self.pending.clear()
        self.received_optimizer = None
