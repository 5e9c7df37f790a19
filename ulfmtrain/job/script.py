"""Your own training script: the communicator it asks for under `launch`, and what it logs.

`connect()` reads what `python -m ulfmtrain launch` told the ranks (hot spares, respawn, a kill schedule
for trying recovery out, the event log's directory) and returns the communicator to train on.  Started
without mpirun, a script runs as a world of one, without fault tolerance, after one warning line.
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

from ..core.events import Event, EventLog

# Set by `launch` for a script's ranks (connect reads them): the hot spares and the replacement policy.
from ..transport.launched import REPLACE_ENV, SPARES_ENV

EVENTS_ENV = "ULFMTRAIN_EVENTS"        # a directory: each rank appends its events to rank<slot>.jsonl there
KILL_ENV = "ULFMTRAIN_KILL"            # kill specs, comma-separated (RANK@STEP[:PHASE]): try recovery out
REQUIRE_ENV = "ULFMTRAIN_REQUIRE_FT"   # 1: refuse to run without fault tolerance (no world of one)
PROG = "ulfmtrain"


def under_mpirun() -> bool:
    """Started by mpirun (or spawned by a rank that was)."""
    return "OMPI_COMM_WORLD_SIZE" in os.environ or "PMIX_RANK" in os.environ


def launch_hint() -> str:
    script = sys.argv[0] if sys.argv and sys.argv[0] else "script.py"
    return f"python -m ulfmtrain launch -n 4 -- python {' '.join([script, *sys.argv[1:]])}"


def connect(events: str | Path | None = None, *, require_fault_tolerance: bool | None = None) -> Any:
    """The communicator of a training script: pass it to DistributedOptimizer and ExactlyOnceSampler.

    Under `launch -n N`: a FaultTolerantComm over the N ranks, with the job's named state (comm.track) and, at
    the script's end, the end check (status 1 and one line if the replicas ended different or out of phase).
    With `--spares K` a spare waits here until a rank dies, then returns as that rank (the first thing it
    makes, its optimizer, receives the live state); a spare never needed ends here, with status 0.  With
    `--replace respawn` a replacement process runs this script again and returns here too.  Without mpirun:
    a world of one, after one warning line, unless `require_fault_tolerance` (or $ULFMTRAIN_REQUIRE_FT=1),
    which refuses with one line and status 2.

    Args:
        events: a directory for the event log (rank<slot>.jsonl: recoveries, and the sampler's audit
            lines for `python -m ulfmtrain audit DIR`); default $ULFMTRAIN_EVENTS, else none.
    """
    from ..training.end_check import end_of_script
    from ..training.job_state import JobState
    from ..transport import faults

    if require_fault_tolerance is None:
        require_fault_tolerance = os.environ.get(REQUIRE_ENV, "") not in ("", "0")
    events = events if events is not None else os.environ.get(EVENTS_ENV) or None
    if not under_mpirun():
        if require_fault_tolerance:
            print(f"{PROG}: error: fault tolerance required but this process was not started by mpirun: run "
                  f"`{launch_hint()}`", file=sys.stderr, flush=True)
            raise SystemExit(2)
        print(f"{PROG}: warning: not started by mpirun: training as a world of one, without fault tolerance "
              f"(run `{launch_hint()}`)", file=sys.stderr, flush=True)
        from mpi4py import MPI

        from ..training.ddp import init_default_group
        from ..transport.comm import PlainComm

        comm: Any = PlainComm(MPI.COMM_SELF)
        attach_events(comm, events)
        init_default_group(comm)
        JobState.of(comm)
        return comm
    from ..core.modes import Replace, UsageError, parse
    from ..training.ddp import init_default_group
    from ..transport import exits
    from ..transport.comm import FaultTolerantComm
    from ..transport.faults import fails_before_ready, parse_kills

    try:
        spares = int(os.environ.get(SPARES_ENV, "0") or 0)
        replace = parse(Replace, os.environ.get(REPLACE_ENV, Replace.NONE) or Replace.NONE, "--replace")
        kills = parse_kills([k for k in os.environ.get(KILL_ENV, "").split(",") if k.strip()])
    except (ValueError, UsageError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if replace is Replace.RESPAWN:
        from ..membership.respawn import RespawnComm
        # A newcomer runs this script again, with its arguments (the kills of its slot have fired).
        comm = RespawnComm(spares, [sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]],
                           fails_before_ready(kills))
    elif spares:
        from ..membership.spares import SpareComm
        comm = SpareComm(spares)
    else:
        comm = FaultTolerantComm()
    if getattr(comm, "is_spare", False):
        # Imported while waiting, not after a failure: the first torch optimizer imports torch._dynamo (2 s).
        importlib.import_module("torch._dynamo")
        if not comm.wait_for_slot():
            raise SystemExit(comm.finalize())     # training ended without needing me
    # At the program's end, before it leaves the job: the end check (phase, then the replicas), then the training
    # ranks let the waiting spares leave and a RespawnComm ends its spawns.
    job = JobState.of(comm)
    exits.before_leave(lambda: end_of_script(comm, job))
    if hasattr(comm, "release_spares"):
        exits.before_leave(comm.close if hasattr(comm, "close") else comm.release_spares)
    joined = getattr(comm, "takeover", None) is not None
    log = attach_events(comm, events)
    faults.arm([k for k in kills if not (joined and k.rank == comm.world_rank)], comm.world_rank, log)
    init_default_group(comm)       # torch.distributed's default group: this communicator's (DDP, dist.all_reduce)
    return comm


class EventSink:
    """Append events to DIR/rank<slot>.jsonl, opened at the first event (a spare learns its slot late)."""

    def __init__(self, directory: str | Path | None, comm: Any) -> None:
        self.directory, self.comm = directory, comm
        self._log: EventLog | None = None

    def __bool__(self) -> bool:
        return self.directory is not None

    def __call__(self, event: Event | str, **fields: Any) -> None:
        if self.directory is None:
            return
        if self._log is None:
            self._log = EventLog(self.directory, self.comm.world_rank)
        self._log(event, **fields)


def attach_events(comm: Any, events: str | Path | None) -> EventSink:
    """Log each recovery of comm (and print one line on the lowest survivor); comm.event_log is the sink."""
    sink = EventSink(events, comm)
    comm.event_log = sink

    def recovered(event: Any) -> None:
        sink(Event.RECOVERY, **event.to_json())
        replaced = sorted(int(s) for s in event.extra.get("replaced") or {})
        vacant = sorted(event.extra.get("vacant") or [])
        # The lowest survivor: with spares, comm rank 0 may be a spare that took slot 0 (it logs nothing here).
        if comm.world_rank != min(w for w in comm.alive if w not in replaced):
            return
        ms = event.detect_ms + event.commit_agree_ms + event.revoke_ms + event.shrink_ms + event.agree_ms
        sizes = f"{event.size_before} -> {event.size_after} ranks"
        if event.what == "refill":
            print(f"{PROG}: at step {event.step} spares took the vacant slots {replaced} ({sizes})", file=sys.stderr,
                  flush=True)
            return
        how = "replaced by spares" if replaced else "removed"
        if vacant:
            how = ("removed and " if event.removed else "") + "vacant until the next step, where spares take them"
        print(f"{PROG}: recovered at step {event.step}: lost ranks {sorted(event.removed) + replaced + vacant} "
              f"({how}, {sizes}), {ms:.1f} ms", file=sys.stderr, flush=True)

    comm.add_listener(recovered)
    return sink
