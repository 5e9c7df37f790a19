"""Open MPI 5.0.x: a death inside MPI_Intercomm_merge leaves the other members in it for good.

Four ranks; rank 0 spawns one process and builds an intercommunicator from the
four to it, as a respawn join does.  Then rank 2 dies 50 ms after the others
entered MPI_Intercomm_merge (it never calls it).  The others never return:
the merge's context-id allreduce fails, its error is lost, and the id
selection retries for ever, printing `NBC_Progress: an error 75` each time.
With REPRO_STEP=intercomm, rank 2 dies during MPI_Intercomm_create instead,
which returns an error on every survivor.  With REPRO_STEP=from-group, the
others build the communicator with MPI_Comm_create_from_group (the union of
the intercommunicator's two groups) instead of merging: that never returns
either (its context id comes from a PMIx group construct, which waits for the
dead member for good).  Each process gives up after
REPRO_GIVE_UP_S seconds (20), printing where it was.

    mpirun --with-ft ulfm -np 4 --mca coll ^han python scripts/repro_merge_loop.py
    (as root on a small box: add --oversubscribe --allow-run-as-root)
"""
import faulthandler
import os
import signal
import sys
import time

from mpi4py import MPI

STEP = os.environ.get("REPRO_STEP", "merge")
VICTIM, DELAY_S, TAG = 2, 0.05, 1711
faulthandler.dump_traceback_later(float(os.environ.get("REPRO_GIVE_UP_S", "20")), exit=True)
parent = MPI.Comm.Get_parent()
who = "newcomer" if parent != MPI.COMM_NULL else f"rank {MPI.COMM_WORLD.Get_rank()}"


def attempt(what: str, call):
    t0 = time.perf_counter()
    try:
        result = call()
        print(f"{who}: {what} returned in {(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)
        return result
    except MPI.Exception as exc:
        print(f"{who}: {what} failed: {exc.Get_error_string()}", flush=True)
        return None


def join(inter, group, high: bool):
    """One communicator of both sides: the merge, or the same group's communicator from a group."""
    if STEP == "from-group":
        attempt("MPI_Comm_create_from_group", lambda: MPI.Intracomm.Create_from_group(
            group, "repro.join", errhandler=MPI.ERRORS_RETURN))
    else:
        attempt("MPI_Intercomm_merge", lambda: inter.Merge(high=high))


if parent != MPI.COMM_NULL:             # the spawned process
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    pool = MPI.Intracomm(parent.Merge(high=True))
    MPI.COMM_WORLD.Set_errhandler(MPI.ERRORS_RETURN)
    inter = attempt("MPI_Intercomm_create", lambda: MPI.COMM_WORLD.Create_intercomm(0, pool, 0, TAG))
    if inter is not None:
        join(inter, MPI.Group.Union(inter.Get_remote_group(), MPI.COMM_WORLD.Get_group()), high=True)
    os._exit(0)

world = MPI.COMM_WORLD.Dup()
world.Set_errhandler(MPI.ERRORS_RETURN)
rank, peer = world.Get_rank(), world
if rank == 0:
    spawned = MPI.COMM_SELF.Spawn(sys.executable, [__file__], maxprocs=1, root=0)
    peer = MPI.Intracomm(spawned.Merge(high=False))
world.Barrier()
if STEP == "intercomm" and rank == VICTIM:
    time.sleep(DELAY_S)
    os.kill(os.getpid(), signal.SIGKILL)
inter = attempt("MPI_Intercomm_create", lambda: world.Create_intercomm(0, peer, 1, TAG))
if inter is not None:
    inter.Set_errhandler(MPI.ERRORS_RETURN)
    world.Barrier()
    if rank == VICTIM:
        time.sleep(DELAY_S)
        os.kill(os.getpid(), signal.SIGKILL)
    join(inter, MPI.Group.Union(world.Get_group(), inter.Get_remote_group()), high=False)
os._exit(0)
