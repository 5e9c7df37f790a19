"""The digits CNN that every system of bench_peers.py trains, and the point where rank 1 waits for its SIGKILL.

One file for all three systems: ulfmtrain loads it by name (`train --model
peers_model:digits_cnn`), the DDP and torchft workers import it.  It loads
ulfmtrain/training/models.py by path, so the torchft virtualenv (which has no
ulfmtrain) trains the very same class.

The kill comes from outside (the driver's SIGKILL), at a program point the same
for every system: with PEERS_KILL="PHASE:STEP:MARKER" set, the process that
trains slot 1 stops once STEP steps have committed, writes its pid to MARKER
and sleeps until the driver kills it.  PHASE `between`: before anything of
step STEP+1 (ulfmtrain: its forward, the first thing a step does; DDP and
torchft: the top of the loop, before torchft's quorum); `allreduce`: in step
STEP+1's backward, once the peers' gradients are on the wire (a hook on the
first layer's weight, whose gradient backward computes last), so the peers
sit inside the allreduce.  MARKER is created exclusively, so a restarted or
respawned process never stops again.
"""
from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import torch

_MODELS = Path(__file__).resolve().parent.parent / "ulfmtrain" / "training" / "models.py"


def _digits_cnn_class() -> type[torch.nn.Module]:
    spec = importlib.util.spec_from_file_location("_peers_ulfmtrain_models", _MODELS)
    assert spec is not None and spec.loader is not None, _MODELS
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.DigitsCNN


class Victim:
    """Counts this process's training steps; at the configured one, stops and waits to be killed."""

    def __init__(self, slot: int | None) -> None:
        spec = os.environ.get("PEERS_KILL", "")
        self.armed = bool(spec) and slot == 1
        self.phase, step, self.marker = (spec.split(":", 2) if spec else ("", "0", ""))
        self.step = int(step)
        self.started = 0       # training steps this process has begun

    def begin_step(self) -> None:
        """Call at the top of each training step (before anything that talks to the peers)."""
        self.started += 1
        if self.phase == "between":
            self._maybe_stop()

    def in_backward(self) -> None:
        if self.phase == "allreduce":
            self._maybe_stop()

    def _maybe_stop(self) -> None:
        if not self.armed or self.started != self.step + 1:
            return
        try:
            os.close(os.open(self.marker + ".claimed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:      # an earlier process of this slot already stopped here
            self.armed = False
            return
        with open(self.marker + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(self.marker + ".tmp", self.marker)     # whole, for the driver that polls for it
        while True:                  # the driver's SIGKILL ends this
            time.sleep(1)


def watch(model: torch.nn.Module, victim: Victim) -> torch.nn.Module:
    """Hook the victim into the model: `between` before its forward, `allreduce` in its backward."""
    first = next(model.parameters())            # the first conv's weight: its gradient comes last
    first.register_hook(lambda g: (victim.in_backward(), g)[1])
    return model


def digits_cnn() -> torch.nn.Module:
    """The factory ulfmtrain loads (`--model peers_model:digits_cnn`): the model, with the kill point of rank 1."""
    model = _digits_cnn_class()()
    slot = os.environ.get("OMPI_COMM_WORLD_RANK")
    # A respawned process is rank 0 of its own spawned world; the marker keeps it from stopping anyway.
    victim = Victim(int(slot) if slot is not None and "PEERS_KILL" in os.environ else None)
    watch(model, victim)

    def pre(module: torch.nn.Module, args: object) -> None:
        if module.training:          # rank 0's test-set evaluation is not a step
            victim.begin_step()

    model.register_forward_pre_hook(pre)
    return model


def new_model() -> torch.nn.Module:
    """The bare model (DDP and torchft workers hook their own loop)."""
    return _digits_cnn_class()()
