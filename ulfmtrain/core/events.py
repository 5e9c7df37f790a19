"""The per-rank event log, declared: every event kind and its fields, the writer, and the readers.

Each rank appends one JSON object per line to OUT/rank<world rank>.jsonl.
The log is the contract between the ranks and every tool (compare,
supervise, demo, audit, the benchmarks and the tests): a kind or a field
not declared here is refused when written.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterable
from enum import StrEnum
from pathlib import Path
from typing import Any


class Event(StrEnum):
    """The event kinds, in the order a run writes them."""

    KILL_ARMED = "kill_armed"                 # a kill schedule fired its first step on this rank
    READY = "ready"                           # restart/reinit: this rank loaded its whole shard
    RESUME = "resume"                         # the state was restored from a checkpoint
    START = "start"                           # training begins: world, holdings, config
    AUDIT = "audit"                           # the record ids of one attempt of a step (--audit)
    STEP = "step"                             # a committed step
    KILL = "kill"                             # this rank SIGKILLs itself now
    INJECTED_ERROR = "injected_error"         # a schedule's error phase: this rank revokes, no rank dies
    RECOVERY = "recovery"                     # a repair (comm.RecoveryEvent)
    LR = "lr"                                 # the learning rate of the first step, and after it changed
    REINIT = "reinit"                         # reinit: the world was rebuilt
    RESPAWN = "respawn"                       # respawn: a spawn started, joined or failed (status)
    EPOCH = "epoch"                           # an epoch ended (test accuracy, checksum)
    CHECKPOINT = "checkpoint"                 # a checkpoint was taken (what it cost this rank)
    CHECKPOINT_WRITTEN = "checkpoint_written"  # rank 0: a checkpoint is durable on disk
    CHECKPOINT_WARNING = "checkpoint_warning"  # a checkpoint could not be written or read
    END = "end"                               # training ended: steps, world history, checksum


# Fields every line of a kind carries (beyond event, rank and t): what the readers rely on.  Writers add more
# (the trainer's start line also has world, alive, holdings, steps_per_epoch, buckets and device).
REQUIRED: dict[Event, frozenset[str]] = {
    Event.KILL_ARMED: frozenset({"step", "phase", "spec"}),
    Event.READY: frozenset({"t_init", "init_ms", "load_ms", "bytes_read", "recovery", "world"}),
    Event.RESUME: frozenset({"file", "step", "epoch", "ckpt_world", "world", "load_ms"}),
    Event.START: frozenset({"count", "config"}),
    Event.AUDIT: frozenset({"step", "attempt", "epoch", "ids"}),
    Event.STEP: frozenset({"step", "loss"}),
    Event.KILL: frozenset({"step", "phase", "spec"}),
    Event.INJECTED_ERROR: frozenset({"step", "spec"}),
    Event.RECOVERY: frozenset({"step", "what", "committed", "size_before", "size_after", "removed"}),
    Event.LR: frozenset({"step", "lr", "world"}),
    Event.REINIT: frozenset({"dead", "size_after"}),
    Event.RESPAWN: frozenset({"status", "slots", "world"}),
    Event.EPOCH: frozenset({"epoch"}),
    Event.CHECKPOINT: frozenset({"step"}),
    Event.CHECKPOINT_WRITTEN: frozenset({"step", "file", "write_ms", "bytes"}),
    Event.CHECKPOINT_WARNING: frozenset({"message"}),
    Event.END: frozenset({"world_history", "checksum", "consistent"}),
}


class EventLog:
    """Append declared events to OUT/rank<world rank>.jsonl.

    Each line is flushed as written, so a rank killed by SIGKILL leaves every
    line it finished.
    """

    def __init__(self, out_dir: str | Path, world_rank: int) -> None:
        self.path = Path(out_dir) / f"rank{world_rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.world_rank = world_rank
        self._f = open(self.path, "a", buffering=1)    # noqa: SIM115 - open for the rank's lifetime

    def __call__(self, event: Event | str, **fields: Any) -> None:
        kind = Event(event)
        missing = REQUIRED[kind] - fields.keys()
        if missing:
            raise ValueError(f"event {kind} without its fields {sorted(missing)} (declared in events.REQUIRED)")
        self._f.write(json.dumps({"event": kind.value, "rank": self.world_rank, "t": time.time(), **fields}) + "\n")

    def close(self) -> None:
        self._f.close()


def read_rank_logs(out_dir: str | Path) -> dict[int, list[dict]]:
    """Every rank's records, keyed by world rank.

    A last line without its newline is one a live rank is still writing (or
    one cut by SIGKILL): it is left out, so logs can be read while a run goes.
    """
    logs = {}
    for p in sorted(Path(out_dir).glob("rank*.jsonl")):
        lines = p.read_text().split("\n")[:-1]     # the piece after the last newline is unfinished
        logs[int(p.stem[4:])] = [_record(p, i, line) for i, line in enumerate(lines, 1) if line.strip()]
    return logs


def _record(path: Path, lineno: int, line: str) -> dict:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path.name} line {lineno} is not a JSON record ({e}); was the file edited by hand?") from e


def select(records: dict[int, list[dict]] | Iterable[dict], kind: Event | str) -> list[dict]:
    """The records of one kind: from one rank's list, or from every rank's (in rank order)."""
    kind = Event(kind)
    recs = (r for rs in records.values() for r in rs) if isinstance(records, dict) else records
    return [r for r in recs if r["event"] == kind]


def loss_curve(records: list[dict]) -> list[tuple[int, float]]:
    """(step, loss) of one rank's step records."""
    return [(r["step"], r["loss"]) for r in select(records, Event.STEP)]
