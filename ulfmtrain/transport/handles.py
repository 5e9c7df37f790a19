"""The MPI handles a process holds: communicators kept alive on purpose (retire), and their count (handles_held).

Open MPI 5.0.11 hands a freed communicator's context id to the next one, and its agreement keys its history by
that id, so the fault path never frees a communicator that a repair left behind: it retires it here.  What that
costs a long job, and what else it holds, is counted by handles_held (benchmarks/bench_soak.py fits its growth
per failure and per step).
"""
from __future__ import annotations

from mpi4py import MPI

_retired: list[MPI.Comm] = []


def retire(comm: MPI.Comm) -> None:
    """Keep a communicator that every survivor has left, instead of freeing it.

    Open MPI 5.0.11 hands a freed communicator's context id to the next one, and its agreement (ERA) keys
    agreements by that id: in long soaks, ranks printed "removing old agreement from history, due to cycling
    of identifiers", and agrees then returned different values on different ranks (one half committed a
    step, the other repaired, and both waited for good).  A few handles per failure is the price.
    """
    _retired.append(comm)


def handles_held(*comms: MPI.Comm) -> dict[str, int]:
    """What this process holds of MPI's handles, for the soak's leak check (a few microseconds).

    comms_retired: the communicators kept by `retire`.  comm_index: Open MPI's highest index among `comms`
    (pass the newest communicators) and the last ones retired: every communicator made in this process and never
    freed takes the lowest free index, and mpi4py frees none it drops, so this counts all of them (spawn and
    merge ones included).
    group_index: the index a new group takes, the same count for groups: each communicator's own, and after
    the first failure two more per agreement (Open MPI 5.0.11's, not freed: benchmarks/README.md).
    """
    probe = MPI.COMM_SELF.Get_group().Incl([0])
    try:
        groups = probe.py2f()
    finally:
        probe.Free()
    newest = [*comms, *_retired[-4:]]        # (a communicator retired just now may be the newest)
    return {"comms_retired": len(_retired), "group_index": groups,
            "comm_index": max((c.py2f() for c in newest if c != MPI.COMM_NULL), default=-1)}
