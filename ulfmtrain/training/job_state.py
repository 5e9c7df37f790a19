"""One named state per job, on the communicator (Horovod Elastic's TorchState): what every replica keeps identical,
what a replacement receives, and what the end check compares.

Every DistributedOptimizer registers its model and optimizer under a name ("opt", "opt1", ... in construction
order, or its name=), the sampler registers itself, and `comm.track(...)` adds a script's schedulers, scalers,
extra models and plain values; the step counts and the random-number state are in it too.  A replacement (a spare,
a respawned process) receives the whole of it in one broadcast, by name: the first thing it registers receives
it, and each name registered later takes its part then.  A name it never registers before its first step, or one
whose state does not fit, ends the job with one line naming it (status 1 on every rank, through the phase check).

The job's step (`comm.step`) is the committed steps of the optimizer that stepped least: a GAN's iterations.  A
replacement's script starts its loop there and runs the survivors' current iteration again from its top: a step
its peers committed in this iteration (a GAN's D step when the failure came in G's) is skipped, not redone; what
the script's own lines changed in the tracked state meanwhile (a scheduler stepped, a scaler updated) is put back
to the survivors' values at its next forward; its first step past those joins the survivors' transaction in
flight.  Until then a collective it calls (comm.allreduce) gives back its own value: its peers ran that one without
it.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from . import serialize
from .buckets import crc32_tensors
from .rng import JobRng

if TYPE_CHECKING:
    from ..transport.comm import Comm


class DistributedOptimizer(Protocol):
    """What the job's state needs of a DistributedOptimizer (optim.py, which imports this module)."""

    name: str
    step_count: int
    optimizer: torch.optim.Optimizer
    model: torch.nn.Module | None

    def _entry(self, live: bool = False) -> dict[str, Any]: ...
    def _load_entry(self, entry: dict[str, Any]) -> None: ...

BCAST = 8                   # in_flight's kind for an optimizer's initial broadcast (phase.py's kinds are below it)
PLAIN = (bool, int, float, str, type(None))
Getter = Callable[[], Any]
Setter = Callable[[Any], None]


def is_plain(value: Any) -> bool:
    """int, float, str, bool, None, and lists and dicts (with str keys) of those."""
    if isinstance(value, PLAIN):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_plain(v) for v in value)
    return isinstance(value, dict) and all(isinstance(k, str) and is_plain(v) for k, v in value.items())


class State:
    """What `comm.track()` returns: each tracked name as an attribute; plain values can be assigned."""

    def __init__(self, job: JobState) -> None:
        object.__setattr__(self, "_job", job)

    def __getattr__(self, name: str) -> Any:
        job: JobState = object.__getattribute__(self, "_job")
        if name in job.values:
            return job.values[name]
        if name in job.objects:
            return job.objects[name]
        raise AttributeError(f"the job's state has no {name!r}: track it first, e.g. `comm.track({name}=0)`")

    def __setattr__(self, name: str, value: Any) -> None:
        job: JobState = object.__getattribute__(self, "_job")
        if name not in job.values:
            what = "a tracked object: change it in place" if name in job.objects else \
                f"not tracked: track it first, `comm.track({name}=...)`"
            raise AttributeError(f"state.{name} is {what}")
        job.values[name] = _checked(name, value)

    def __dir__(self) -> list[str]:
        job: JobState = object.__getattribute__(self, "_job")
        return sorted([*job.values, *job.objects])

    def __repr__(self) -> str:
        job: JobState = object.__getattribute__(self, "_job")
        return f"State({', '.join([*(f'{k}={v!r}' for k, v in job.values.items()), *job.objects])})"


def _checked(name: str, value: Any) -> Any:
    if not is_plain(value):
        raise TypeError(f"comm.track({name}=...): a {type(value).__name__} is neither a plain value (int, float, "
                        "str, bool, or lists and dicts of those) nor an object with state_dict() and "
                        "load_state_dict()")
    return value


class JobState:
    """The named state of one job (see the module's docstring); `JobState.of(comm)` makes or finds it."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.entries: dict[str, tuple[Getter, Setter]] = {}    # registered objects, by name
        self.values: dict[str, Any] = {}                       # tracked plain values
        self.objects: dict[str, Any] = {}                      # tracked objects (also in entries)
        self.optimizers: list[DistributedOptimizer] = []
        self.state = State(self)
        # Where a replacement can come (a SpareComm), the survivors keep the RNG state as each step began.
        self.rng = JobRng(keep=hasattr(comm, "handover"))
        self.samples: int | None = None           # this rank's samples in each step (the sampler says)
        self.lead: int | None = None              # batches its loop took past the step in flight (the sampler)
        self.problem: str | None = None           # a replacement that cannot take the state: why (phase check)
        self.stopped = False                      # the phase check ended the job
        self.in_flight: tuple[int, str] = (0, "")   # the kind and optimizer of the transaction this rank is in
        self._last_step = 0
        self.commits_here = 0                     # steps this process committed (a replacement: with its peers)
        self._since: dict[str, int] = {}          # steps each optimizer committed since the job's step advanced
        self._commit_hooks: list[Callable[[], None]] = []
        self._attempt_hooks: list[Callable[[int, int], None]] = []
        # A replacement: what it received, by name, until each name is registered; and while it catches up.
        self.pending: dict[str, Any] = {}
        self.pending_values: dict[str, Any] = {}
        self.catching_up = False
        self._arrived = False
        self._received: dict[str, Any] | None = None
        self._skip: dict[str, int] = {}
        self._restore_due = False
        self._received_optimizers: dict[str, dict[str, Any]] = {}
        self._unrestored: set[str] = set()
        if hasattr(comm, "handover"):
            setattr(comm, "handover", self)  # noqa: B010  # a SpareComm's: it calls payload()/take()

    @classmethod
    def of(cls, comm: Comm) -> JobState:
        """The job's state on `comm`, made at the first call."""
        job = getattr(comm, "job", None)
        if job is None:
            job = cls(comm)
            comm.job = job
        return job

    # -- registration --------------------------------------------------------------
    def add_optimizer(self, opt: DistributedOptimizer) -> None:
        """Register a DistributedOptimizer (its model, optimizer and step) under its name."""
        self.optimizers.append(opt)
        self.register(opt.name, opt._entry, opt._load_entry)

    def name_of(self, index: int) -> str:
        """The name of the index-th optimizer (phase check lines)."""
        return self.optimizers[index].name if 0 <= index < len(self.optimizers) else f"optimizer {index}"

    def register(self, name: str, get: Getter, set: Setter, *, restore: bool = True) -> None:
        """Make (get, set) part of the state under `name`; a replacement that received it loads it now.
        `restore=False`: a state that only commits and re-plans change (the sampler's), which a replacement's
        skipped step has none of: its catch-up does not put it back (`_restore`)."""
        if name in self.entries or name in self.values:
            raise ValueError(f"the job's state has a {name!r} already: give each optimizer and tracked object its "
                             "own name")
        self.entries[name] = (get, set)
        if not restore:
            self._unrestored.add(name)
        if name in self.pending:
            self._load(name, self.pending.pop(name), late=True)
        self._arrive()

    def track(self, **named: Any) -> State:
        """comm.track(): objects with state_dict()/load_state_dict() and plain values (see ScriptCollectives)."""
        for name, value in named.items():
            if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
                if not isinstance(value, serialize.Pickled):
                    serialize.check_loadable(name, value.state_dict())     # refused now, not at a hand-over
                self.register(name, value.state_dict, value.load_state_dict)
                self.objects[name] = value
                continue
            if name in self.entries or name in self.values:
                raise ValueError(f"comm.track({name}=...): the job's state has a {name!r} already")
            self.values[name] = self.pending_values.pop(name, _checked(name, value))
            self._arrive()
        return self.state

    def _arrive(self) -> None:
        """A replacement's first registration or collective: the survivors hand it the state now (they wait for
        it).  One that took its slot during their start-up gets nothing: it joins their first optimizer's
        initial broadcast, which they start over with it, and runs no collective before."""
        if self._arrived:
            return
        self._arrived = True
        takeover = getattr(self.comm, "takeover", None)
        if takeover is None:
            return
        if takeover.get("startup"):
            self.catching_up, self.in_flight = True, (BCAST, "")
        else:
            self.comm.hand_over()       # type: ignore[attr-defined]  # a SpareComm's: take() loads it

    # -- the job's step --------------------------------------------------------------
    @property
    def step(self) -> int:
        """Committed steps of the optimizer that stepped least (0 before any)."""
        return min((o.step_count for o in self.optimizers), default=0)

    def committed_ahead(self) -> list[DistributedOptimizer]:
        """The optimizers that committed a step since the job's step last advanced (a GAN's D, between its step
        and G's): replicated, a replacement receives it."""
        return [o for o in self.optimizers if self._since.get(o.name)]

    def advancing(self, opt: DistributedOptimizer) -> bool:
        """Whether opt's next commit advances the job's step (it alone has the fewest steps)."""
        return all(o.step_count > opt.step_count for o in self.optimizers if o is not opt) and \
            opt.step_count == self.step

    def attempt(self, opt: DistributedOptimizer, attempt: int) -> None:
        """Before this rank's first contribution to an attempt of opt's step: the sampler's audit line."""
        self.lead = None            # this attempt's alone (one set and never sent: a caught error)
        if self.advancing(opt):
            for fn in self._attempt_hooks:
                fn(opt.step_count, attempt)

    def committed(self, opt: DistributedOptimizer) -> None:
        """opt's step committed (its count is up): when the job's step advances, the sampler advances."""
        self._since[opt.name] = self._since.get(opt.name, 0) + 1
        self.commits_here += 1
        self._received_optimizers.clear()       # what was received is history: later objects keep their state
        if self.step > self._last_step:
            self._last_step = self.step
            self._since.clear()
            self.rng.advanced()
            for fn in self._commit_hooks:
                fn()

    _register_extra_state = register      # the sampler's call, as on a DistributedOptimizer

    def _add_commit_hook(self, fn: Callable[[], None]) -> None:
        self._commit_hooks.append(fn)

    def _add_attempt_hook(self, fn: Callable[[int, int], None]) -> None:
        self._attempt_hooks.append(fn)

    def _expect_samples(self, samples: int | None) -> None:
        self.samples = samples

    # -- a replacement catching up ------------------------------------------------------
    def skip(self, opt: DistributedOptimizer) -> bool:
        """A replacement's step that its peers committed already in this iteration: skip it (True)."""
        if not self.catching_up or not self._skip.get(opt.name):
            return False
        self._skip[opt.name] -= 1
        self._restore_due = True
        return True

    def skips(self, name: str) -> int:
        """Steps of `name` this replacement is yet to skip (its peers committed them in the iteration it replays)."""
        return self._skip.get(name, 0) if self.catching_up else 0

    def replaying(self, kind: int) -> bool:
        """A replacement that has not reached the survivors' transaction: a collective of `kind` is not it."""
        self._arrive()
        return self.catching_up and (any(self._skip.values()) or self.in_flight[0] != kind)

    def joins(self, kind: int, name: str = "") -> bool:
        """Whether this transaction is the one the survivors are in (always, past the catch-up)."""
        return not self.catching_up or (self.in_flight in ((kind, name), (kind, "")) and not any(self._skip.values()))

    def forward(self) -> None:
        """A training forward of one of the job's models: the RNG as the step began; after a skipped step, the
        tracked state back to the survivors' values."""
        if self._restore_due:
            self._restore()
        self.rng.forward()

    def joined(self) -> None:
        """This rank takes part in a transaction with its peers: a replacement is caught up."""
        self._arrive()
        if not self.catching_up:
            return
        if self._restore_due:
            self._restore()
        self.catching_up, self._received = False, None
        missing = sorted([*self.pending, *self.pending_values])
        if missing and self.problem is None:
            self.problem = (f"ulfmtrain: error: the survivors hold {', '.join(map(repr, missing))}, which this "
                            f"replacement (slot {self.comm.world_rank}) did not register before its first step: "
                            "make and track every optimizer and object at the same point on every rank, under "
                            "the same names (DistributedOptimizer(..., name=...), comm.track(...))")
        self._received_optimizers.clear()

    def _restore(self) -> None:
        self._restore_due = False
        if self._received is not None:
            kept = {k: v for k, v in self._received["entries"].items() if k not in self._unrestored}
            self._load_all({**self._received, "entries": kept})

    # -- the hand-over -------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Every registered entry and value, by name (no RNG: each rank's own)."""
        return {"entries": {k: get() for k, (get, _) in self.entries.items()}, "values": dict(self.values)}

    def payload(self) -> bytes:
        """The state a sender hands a replacement: everything, the RNG as the step began, where the job is."""
        state = {**self.snapshot(), "rng": self.rng.state(), "since": dict(self._since),
                 "in_flight": self.in_flight, "samples": self.samples, "last_step": self._last_step}
        return serialize.dumps(state)

    def take(self, blob: bytes) -> None:
        """A replacement takes payload(): each name registered now loads, the others when they are registered."""
        state = serialize.loads(blob)
        self._load_all(state)
        self.rng.pending = state.get("rng")
        self._since, self._last_step = dict(state["since"]), state["last_step"]
        self._skip = {k: v for k, v in state["since"].items() if v}
        self.in_flight, self.samples = (state["in_flight"][0], state["in_flight"][1]), state["samples"]
        self._received, self.catching_up = state, True

    def load(self, blob: bytes) -> None:
        """Take a state made by payload() where nothing is to be caught up (a checkpoint's, a broadcast's)."""
        state = serialize.loads(blob)
        self._load_all(state)

    def _load_all(self, state: dict[str, Any]) -> None:
        for name, value in state["entries"].items():
            if name in self.entries:
                self._load(name, value, late=False)
            else:
                self.pending[name] = value
        for name, value in state["values"].items():
            if name in self.values:
                self.values[name] = value
            else:
                self.pending_values[name] = value

    def _load(self, name: str, value: Any, late: bool) -> None:
        try:
            self.entries[name][1](value)
        except Exception as exc:  # noqa: BLE001  # any mismatch: said once, and the job ends (phase check)
            if self.problem is None:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                self.problem = (f"ulfmtrain: error: the survivors' {name!r} does not fit this replacement's (slot "
                                f"{self.comm.world_rank}: {first}): make and track every object at the same point "
                                "on every rank, under the same names")
            return
        if any(o.name == name for o in self.optimizers):
            self._received_optimizers[name] = value["optimizer"]
        elif late:
            # An object made after the state arrived (a scheduler needs its optimizer first): its constructor
            # wrote the learning rates again; the received ones count.
            for o in self.optimizers:
                if o.name in self._received_optimizers:
                    o.optimizer.load_state_dict(self._received_optimizers[o.name])

    # -- the end check's fingerprint ------------------------------------------------------
    def checksum(self) -> int:
        """CRC32 of every entry and value and each optimizer's step, as the replicas hold them now (a model's
        buffers too, which a hand-over sends as of the last commit): equal on replicas that hold the same state."""
        opts = {o.name: o for o in self.optimizers}
        entries = {k: opts[k]._entry(live=True) if k in opts else get() for k, (get, _) in self.entries.items()}
        crc = 0
        for name, value in sorted(entries.items()) + sorted(self.values.items()):
            crc = _fingerprint(value, zlib.crc32(name.encode(), crc))
        return crc


def _fingerprint(obj: Any, crc: int) -> int:
    if isinstance(obj, torch.Tensor):
        return crc32_tensors([obj], crc)
    if isinstance(obj, np.ndarray):
        return zlib.crc32(np.ascontiguousarray(obj).tobytes(), crc)
    if isinstance(obj, dict):
        for k in sorted(obj, key=str):
            crc = _fingerprint(obj[k], zlib.crc32(repr(k).encode(), crc))
        return crc
    if isinstance(obj, (list, tuple)):
        for v in obj:
            crc = _fingerprint(v, crc)
        return crc
    return zlib.crc32(repr(obj).encode(), crc)
