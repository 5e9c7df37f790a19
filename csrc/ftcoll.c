/* The fault path: collectives that return errors instead of aborting, the
 * commit agree, and the revoke -> shrink -> agree sequence that repairs the
 * communicator.  Policy (what a failure means for training, what is redone)
 * lives in Python; this file only moves bytes and repairs communicators. */
#include "ftcoll.h"
#include "ulfm_compat.h"

#include <limits.h>
#include <semaphore.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

/* Shrink itself can meet a new failure; give up only after this many tries. */
#define FTC_MAX_SHRINK_TRIES 64

static int ftc_killpoint = FTC_KILL_NONE;
static int ftc_killsignal = SIGKILL;
static MPI_Count ftc_max_chunk = INT_MAX;   /* MPI_Allreduce takes an int count */

void ftc_set_killpoint(int point, int sig)
{
    ftc_killpoint = point;
    ftc_killsignal = sig;
}

void ftc_set_max_chunk(MPI_Count elements)
{
    ftc_max_chunk = elements < 1 ? 1 : (elements > INT_MAX ? INT_MAX : elements);
}

static void maybe_kill(int point)
{
    if (ftc_killpoint == point) {
        ftc_killpoint = FTC_KILL_NONE;
        kill(getpid(), ftc_killsignal);    /* SIGSTOP: a rank frozen inside the repair */
    }
}

/* Fault injection: this thread sleeps for good on a lock that nobody releases,
 * inside an MPI call, as a deadlock inside the MPI library does (a soak met one
 * in Open MPI's TCP transport); only the hang watch can end such a rank. */
static void maybe_wedge(void)
{
    sem_t never;
    if (ftc_killpoint != FTC_WEDGE_IN_REDUCTION)
        return;
    ftc_killpoint = FTC_KILL_NONE;
    sem_init(&never, 0, 0);
    for (;;)
        sem_wait(&never);
}

static double ms_since(double t0) { return (MPI_Wtime() - t0) * 1e3; }

int ftc_status_of(int rc)
{
    int cls = rc;
    if (rc == MPI_SUCCESS)
        return FTC_OK;
    MPI_Error_class(rc, &cls);
    return ulfm_is_failure(cls) ? FTC_FAILED : FTC_ERROR;
}

void ftc_revoke(MPI_Comm comm) { MPIX_Comm_revoke(comm); }

/* After an error: revoke, so that no peer waits for this rank in a
 * collective it will never finish (it goes to the commit agree instead). */
static int attempt_done(int rc, MPI_Comm comm)
{
    if (rc != MPI_SUCCESS)
        MPIX_Comm_revoke(comm);
    return ftc_status_of(rc);
}

int ftc_allreduce_try(const void *sendbuf, void *recvbuf, MPI_Count count,
                      MPI_Datatype datatype, MPI_Op op, MPI_Comm comm)
{
    MPI_Aint lb, extent;
    int rc = MPI_Type_get_extent(datatype, &lb, &extent);
    maybe_wedge();
    for (MPI_Count done = 0; rc == MPI_SUCCESS && done < count;) {
        MPI_Count n = count - done < ftc_max_chunk ? count - done : ftc_max_chunk;
        rc = MPI_Allreduce((const char *)sendbuf + done * extent,
                           (char *)recvbuf + done * extent, (int)n, datatype,
                           op, comm);
        done += n;
    }
    return attempt_done(rc, comm);
}

int ftc_bcast_try(void *buf, MPI_Count count, MPI_Datatype datatype,
                  int root, MPI_Comm comm)
{
    MPI_Aint lb, extent;
    int rc = MPI_Type_get_extent(datatype, &lb, &extent);
    for (MPI_Count done = 0; rc == MPI_SUCCESS && done < count;) {
        MPI_Count n = count - done < ftc_max_chunk ? count - done : ftc_max_chunk;
        rc = MPI_Bcast((char *)buf + done * extent, (int)n, datatype, root, comm);
        done += n;
    }
    return attempt_done(rc, comm);
}

int ftc_send_try(const void *buf, MPI_Count count, MPI_Datatype datatype,
                 int dest, int tag, MPI_Comm comm)
{
    MPI_Aint lb, extent;
    int rc = MPI_Type_get_extent(datatype, &lb, &extent);
    for (MPI_Count done = 0; rc == MPI_SUCCESS && done < count;) {
        MPI_Count n = count - done < ftc_max_chunk ? count - done : ftc_max_chunk;
        rc = MPI_Send((const char *)buf + done * extent, (int)n, datatype, dest, tag, comm);
        done += n;
    }
    return attempt_done(rc, comm);
}

int ftc_recv_try(void *buf, MPI_Count count, MPI_Datatype datatype,
                 int source, int tag, MPI_Comm comm)
{
    MPI_Aint lb, extent;
    int rc = MPI_Type_get_extent(datatype, &lb, &extent);
    for (MPI_Count done = 0; rc == MPI_SUCCESS && done < count;) {
        MPI_Count n = count - done < ftc_max_chunk ? count - done : ftc_max_chunk;
        rc = MPI_Recv((char *)buf + done * extent, (int)n, datatype, source, tag, comm,
                      MPI_STATUS_IGNORE);
        done += n;
    }
    return attempt_done(rc, comm);
}

int ftc_agree(MPI_Comm comm, int *flag)
{
    return ftc_status_of(MPIX_Comm_agree(comm, flag));
}

int ftc_repair(MPI_Comm *comm, ftc_report *rep)
{
    MPI_Comm given = *comm;
    for (int tries = 0; tries < FTC_MAX_SHRINK_TRIES; tries++) {
        MPI_Comm old = *comm, fresh = MPI_COMM_NULL;
        double t = MPI_Wtime();
        int rc;

        /* Revoke so that every peer, whatever it is blocked in on `old`,
         * errors out and joins the shrink. */
        MPIX_Comm_revoke(old);
        rep->revoke_ms += ms_since(t);
        maybe_kill(FTC_KILL_AFTER_REVOKE);

        t = MPI_Wtime();
        rc = MPIX_Comm_shrink(old, &fresh);
        rep->shrink_ms += ms_since(t);
        if (rc != MPI_SUCCESS) {
            if (ftc_status_of(rc) == FTC_FAILED)
                continue;
            rep->mpi_error = rc;
            return FTC_ERROR;
        }
        MPI_Comm_set_errhandler(fresh, MPI_ERRORS_RETURN);
        rep->shrinks++;
        /* A communicator made inside this repair that a second failure made
         * useless: every survivor has left it (the shrink on it completed). */
        if (old != given)
            MPI_Comm_free(&old);
        *comm = fresh;
        maybe_kill(FTC_KILL_AFTER_SHRINK);

        /* Agree before first use, so no peer is still building `fresh`.  The
         * agree's return code is not uniform (one survivor can see a death in
         * it that another does not): a second agree on "my first one was OK"
         * gives every survivor the same answer, keep `fresh` or shrink again. */
        t = MPI_Wtime();
        int flag = 1;
        rc = MPIX_Comm_agree(fresh, &flag);
        int clean = rc == MPI_SUCCESS;
        (void)MPIX_Comm_agree(fresh, &clean);
        rep->agree_ms += ms_since(t);
        if (clean)
            return FTC_OK;
        rep->mpi_error = rc;    /* a process failure: shrink again; another error too, a bounded number of times */
    }
    rep->mpi_error = MPI_ERR_INTERN;
    return FTC_ERROR;
}
