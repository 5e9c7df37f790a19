/* Fault-tolerant collectives on ULFM: attempts with errors returned, a
 * uniform commit agree, and the revoke -> shrink -> agree repair. */
#ifndef ULFMTRAIN_FTCOLL_H
#define ULFMTRAIN_FTCOLL_H

#include <mpi.h>

/* A step (or any collective outside it) is a transaction: each rank runs
 * its attempt with errors returned, then every live rank takes part in one
 * MPIX_Comm_agree on "my part completed".  The agreed flag is the same on
 * every survivor, and so is the error it returns when a rank died (Open MPI
 * raises MPIX_ERR_PROC_FAILED consistently at all ranks while no failure is
 * acknowledged, and we acknowledge none).  Commit iff the flag is 1; repair
 * iff the agree reported a failure or the flag is 0.  Nothing here retries:
 * the caller redoes an aborted attempt on the repaired communicator. */

enum ftc_status {
    FTC_OK = 0,         /* completed */
    FTC_FAILED = 1,     /* a process failure: the communicator is revoked;
                           go to the commit agree, then repair */
    FTC_ERROR = 2       /* an MPI error that is not a process failure */
};

/* Fault-injection points inside the repair (for tests of a kill during it). */
enum ftc_killpoint {
    FTC_KILL_NONE = 0,
    FTC_KILL_AFTER_REVOKE = 1,
    FTC_KILL_AFTER_SHRINK = 2,
    FTC_WEDGE_IN_REDUCTION = 3  /* the next reduction sleeps for good on a lock */
};

typedef struct {
    int mpi_error;        /* the MPI error when ftc_repair fails */
    double revoke_ms, shrink_ms, agree_ms;  /* summed over shrink rounds */
    int shrinks;          /* communicators made (more than 1: a rank died
                             during the repair) */
} ftc_report;

/* Classify an MPI return code: FTC_OK, FTC_FAILED or FTC_ERROR. */
int ftc_status_of(int rc);

/* One attempt of an allreduce of `count` elements from sendbuf into recvbuf
 * (distinct buffers: a failed reduction leaves recvbuf undefined, and the
 * redo needs the contribution).  Counts are 64-bit: larger reductions go in
 * pieces of at most ftc_max_chunk elements.  On any error the communicator is
 * revoked, so that peers blocked in this or a later collective leave it and
 * meet at the commit agree.  Returns an ftc_status. */
int ftc_allreduce_try(const void *sendbuf, void *recvbuf, MPI_Count count,
                      MPI_Datatype datatype, MPI_Op op, MPI_Comm comm);

/* One attempt of a broadcast, with the same rules. */
int ftc_bcast_try(void *buf, MPI_Count count, MPI_Datatype datatype,
                  int root, MPI_Comm comm);

/* One attempt of a point-to-point transfer (the hand-over of the state to a
 * replacement, which only it needs), with the same rules: chunked counts,
 * and on any error the communicator is revoked. */
int ftc_send_try(const void *buf, MPI_Count count, MPI_Datatype datatype,
                 int dest, int tag, MPI_Comm comm);
int ftc_recv_try(void *buf, MPI_Count count, MPI_Datatype datatype,
                 int source, int tag, MPI_Comm comm);

/* Revoke comm (after an error met elsewhere, e.g. in an mpi4py call). */
void ftc_revoke(MPI_Comm comm);

/* The commit decision: *flag becomes the bitwise AND over the live ranks.
 * Returns an ftc_status, FTC_FAILED when some rank did not contribute; both
 * the flag and the status are the same on every survivor. */
int ftc_agree(MPI_Comm comm, int *flag);

/* Revoke *comm, shrink it and agree on the result, again while ranks die
 * during the repair.  *comm is replaced by the new communicator; the one
 * passed in stays the caller's to free, intermediate ones are freed here. */
int ftc_repair(MPI_Comm *comm, ftc_report *report);

/* Largest piece of one reduction in elements (tests set it small). */
void ftc_set_max_chunk(MPI_Count elements);

/* Arm a signal (SIGKILL; SIGSTOP freezes the process) inside the next repair
 * of this process (tests only). */
void ftc_set_killpoint(int point, int sig);

#endif /* ULFMTRAIN_FTCOLL_H */
