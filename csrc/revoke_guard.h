/* A guard around one crash of Open MPI 5.0.10 and later (PR #13420): ompi_comm_revoke_local calls
 * comm->c_coll->coll_revoke_local unconditionally, and a process failure reported while a communicator is
 * being built (entered in the table, its collectives not yet selected by ompi_comm_activate: c_coll NULL) is
 * applied to it too, so a survivor inside MPI_Comm_split segfaults (address 0x450; docs/failures.md, "Two
 * deaths a few milliseconds apart").  Several survivors in one split crash at once, and a job lost every
 * holder of its state so (the 1000-failure soak, benchmarks/README.md 5j).
 *
 * The guard replaces libmpi's own entry for ompi_comm_revoke_local in its procedure linkage table (each
 * caller inside libmpi goes through it) with a function that gives such a communicator an empty table of
 * collectives for the length of the call: the revoke of the point-to-point layer and the wake-up happen as
 * before 5.0.10, and the split returns an error the fault path handles.  Only where the code of
 * ompi_comm_revoke_local is the one it knows (x86-64, the offsets of this build), else nothing is changed. */
#ifndef ULFMTRAIN_REVOKE_GUARD_H
#define ULFMTRAIN_REVOKE_GUARD_H

/* Put the guard in place (idempotent; callable before MPI_Init).  Returns 1 when it is in place, 0 where it
 * does not apply (another build of Open MPI), -1 when libmpi's table was not found or not writable. */
int ftc_guard_revoke(void);

/* Revoke a duplicate of MPI_COMM_SELF as a communicator whose collectives are not selected yet, through the
 * entry libmpi's own callers use (MPI initialized).  Returns 1 when it was revoked; without the guard in
 * place it crashes, as Open MPI does in that race. */
int ftc_guard_selftest(void);

#endif /* ULFMTRAIN_REVOKE_GUARD_H */
