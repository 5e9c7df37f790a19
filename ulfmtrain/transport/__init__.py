"""Layer 2, the MPI transport: one bounded start and end, the step transaction and its repair, fault injection.

lifecycle (bounded MPI_Init and MPI_Finalize), comm (the fault-tolerant communicator), handles (the
communicators it keeps alive, and the count of MPI handles held), faults (kill schedules and injection), stall
(the watchdogs), hangs and board (the hang watch: a rank that makes no progress for a bound fails), exits (how a
rank leaves the job), tether (the rank's end of the keep-alive link of `launch --agent`: comm's repair asks its
gate, so it sits here, below the launchers that start it by path), jobtree (a job's processes on one host: a
rank ends with its launcher, a launcher ends its job's tree), phase (the tag that starts every script-level
transaction), collectives (what a script calls on its communicator: allreduce, barrier, step, track), launched
(what `launch` told a script's ranks).  The C fault path is the extension ulfmtrain._ftcoll, below every layer.

The rule: a module here imports only from this layer and the ones below (core, _ftcoll); the layers, lowest
first, are ulfmtrain._LAYERS.
"""
