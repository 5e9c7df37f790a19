/* Fault-tolerant collectives on ULFM: run, and on a process failure
 * revoke -> shrink -> agree -> retry on the shrunk communicator. */
#ifndef ULFMTRAIN_FTCOLL_H
#define ULFMTRAIN_FTCOLL_H

#include <mpi.h>

#define FTC_MAX_ROUNDS 16      /* shrinks recorded in one call */
#define FTC_MAX_REMOVED 256    /* world ranks recorded per shrink */

enum ftc_status {
    FTC_OK = 0,         /* completed on the communicator it was given */
    FTC_RECOVERED = 1,  /* completed on a shrunk communicator (*comm replaced) */
    FTC_DIVERGED = 2,   /* shrunk, but survivors stand at different tags:
                           the caller must bring them level, then call again */
    FTC_ERROR = 3       /* an MPI error that is not a process failure */
};

/* Fault-injection points inside recovery (for tests of a kill during it). */
enum ftc_killpoint {
    FTC_KILL_NONE = 0,
    FTC_KILL_AFTER_REVOKE = 1,
    FTC_KILL_AFTER_SHRINK = 2
};

typedef struct {
    int size_after;                    /* size of the communicator it made */
    int nremoved;                      /* world ranks the shrink left out */
    int removed[FTC_MAX_REMOVED];
} ftc_round;

typedef struct {
    int status;
    int mpi_error;        /* the MPI error code when status == FTC_ERROR */
    int error_class;      /* class of the first failure seen (75/76/77) */
    double t_error;       /* MPI_Wtime() when the first failure came back */
    double detect_ms;     /* time inside the collective that failed */
    double revoke_ms, shrink_ms, agree_ms, sync_ms; /* summed over rounds */
    double retry_ms;      /* the successful retry on the new communicator */
    int tag_max, tag_min; /* tags of the survivors after the last shrink */
    int root;             /* lowest new rank holding tag_max */
    int nfailed;          /* MPIX_Comm_get_failed, as world ranks */
    int failed[FTC_MAX_REMOVED];
    int nrounds;
    ftc_round rounds[FTC_MAX_ROUNDS];
} ftc_report;

/* Allreduce sendbuf into recvbuf (distinct buffers: a failed in-place
 * reduction leaves its buffer undefined, so the contribution must survive
 * for the retry).  On a failure *comm is replaced by the shrunk
 * communicator; the caller owns it.  `tag` names the caller's program point
 * (the training step): survivors retry only while their tags agree. */
int ftc_allreduce(const void *sendbuf, void *recvbuf, int count,
                  MPI_Datatype datatype, MPI_Op op, MPI_Comm *comm,
                  int tag, ftc_report *report);

/* Uniform agreement (bitwise AND of flag) that survives failures. */
int ftc_agree(int *flag, MPI_Comm *comm, int tag, ftc_report *report);

/* Revoke *comm, shrink it, agree on the result and exchange tags.  For a
 * failure the caller met outside these functions (e.g. in a broadcast). */
int ftc_recover(MPI_Comm *comm, int tag, ftc_report *report);

/* MPI_Finalize, but _exit(exit_code) if it has not returned within
 * timeout_s: after a failure it can hang (ompi #11404).  The watchdog is a
 * C thread because the caller may hold a lock (Python's GIL) meanwhile. */
int ftc_finalize(double timeout_s, int exit_code);

/* Arm a kill inside the next recovery of this process (tests only). */
void ftc_set_killpoint(int point);

#endif /* ULFMTRAIN_FTCOLL_H */
