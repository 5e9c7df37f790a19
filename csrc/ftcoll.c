/* The fault path: collectives that return errors instead of aborting, and
 * the revoke -> shrink -> agree sequence that repairs the communicator.
 * Policy (what a failure means for training) lives in Python; this file
 * only moves bytes and repairs communicators. */
#include "ftcoll.h"
#include "ulfm_compat.h"

#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Shrink itself can meet a new failure; give up only after this many tries. */
#define FTC_MAX_SHRINK_TRIES 64

static int ftc_killpoint = FTC_KILL_NONE;

void ftc_set_killpoint(int point) { ftc_killpoint = point; }

static void maybe_kill(int point)
{
    if (ftc_killpoint == point) {
        ftc_killpoint = FTC_KILL_NONE;
        kill(getpid(), SIGKILL);
    }
}

static double ms_since(double t0) { return (MPI_Wtime() - t0) * 1e3; }

static int error_class(int rc)
{
    int cls = rc;
    MPI_Error_class(rc, &cls);
    return cls;
}

static int finish(ftc_report *rep, int status)
{
    rep->status = status;
    return status;
}

static int fail(ftc_report *rep, int rc)
{
    rep->mpi_error = rc;
    return finish(rep, FTC_ERROR);
}

static void note_failure(ftc_report *rep, int cls, double t_call)
{
    if (rep->error_class != 0)
        return;              /* keep the first failure of this call */
    rep->error_class = cls;
    rep->t_error = MPI_Wtime();
    rep->detect_ms = (rep->t_error - t_call) * 1e3;
}

/* Translate `n` ranks of `group` into MPI_COMM_WORLD ranks. */
static void to_world(MPI_Group group, int n, int *out)
{
    MPI_Group world;
    int ranks[FTC_MAX_REMOVED];
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    for (int i = 0; i < n; i++)
        ranks[i] = i;
    MPI_Group_translate_ranks(group, n, ranks, world, out);
    MPI_Group_free(&world);
}

static void add_failed(ftc_report *rep, int world_rank)
{
    for (int i = 0; i < rep->nfailed; i++)
        if (rep->failed[i] == world_rank)
            return;
    if (rep->nfailed < FTC_MAX_REMOVED)
        rep->failed[rep->nfailed++] = world_rank;
}

/* Record who the shrink left out (the same on every survivor, so the data
 * plan built from it is too) and who this process has seen fail. */
static void record_round(MPI_Comm old, MPI_Comm fresh, ftc_report *rep)
{
    MPI_Group og, ng, gone, failed;
    int n = 0, world[FTC_MAX_REMOVED];

    MPI_Comm_group(old, &og);
    MPI_Comm_group(fresh, &ng);
    MPI_Group_difference(og, ng, &gone);
    MPI_Group_size(gone, &n);
    if (n > FTC_MAX_REMOVED)
        n = FTC_MAX_REMOVED;

    if (rep->nrounds < FTC_MAX_ROUNDS) {
        ftc_round *round = &rep->rounds[rep->nrounds];
        MPI_Comm_size(fresh, &round->size_after);
        round->nremoved = n;
        to_world(gone, n, round->removed);
    }
    rep->nrounds++;

    if (MPIX_Comm_get_failed(old, &failed) == MPI_SUCCESS) {
        MPI_Group_size(failed, &n);
        if (n > FTC_MAX_REMOVED)
            n = FTC_MAX_REMOVED;
        to_world(failed, n, world);
        for (int i = 0; i < n; i++)
            add_failed(rep, world[i]);
        MPI_Group_free(&failed);
    }
    MPI_Group_free(&og);
    MPI_Group_free(&ng);
    MPI_Group_free(&gone);
}

/* One allreduce tells every survivor the highest tag, the lowest, and the
 * lowest rank that holds the highest (MAXLOC breaks ties by lower index). */
static int exchange_tags(MPI_Comm comm, int tag, ftc_report *rep)
{
    struct { int value; int index; } in[2], out[2];
    int rank, rc;

    MPI_Comm_rank(comm, &rank);
    in[0].value = tag;
    in[0].index = rank;
    in[1].value = -tag;
    in[1].index = rank;
    rc = MPI_Allreduce(in, out, 2, MPI_2INT, MPI_MAXLOC, comm);
    if (rc == MPI_SUCCESS) {
        rep->tag_max = out[0].value;
        rep->root = out[0].index;
        rep->tag_min = -out[1].value;
    }
    return rc;
}

static int repair(MPI_Comm *comm, int tag, ftc_report *rep)
{
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
            if (ulfm_is_failure(error_class(rc)))
                continue;
            return rc;
        }
        MPI_Comm_set_errhandler(fresh, MPI_ERRORS_RETURN);
        record_round(old, fresh, rep);
        /* The old communicators are not freed: a revoked communicator is
         * cheap to keep, and freeing one that a lagging peer still reaches
         * for is the crash the ULFM suite's revshrink case shows. */
        *comm = fresh;
        maybe_kill(FTC_KILL_AFTER_SHRINK);

        /* Agree before first use, so no peer is still building `fresh`. */
        t = MPI_Wtime();
        int flag = 1;
        rc = MPIX_Comm_agree(fresh, &flag);
        rep->agree_ms += ms_since(t);
        if (rc != MPI_SUCCESS) {
            if (ulfm_is_failure(error_class(rc)))
                continue;
            return rc;
        }

        t = MPI_Wtime();
        rc = exchange_tags(fresh, tag, rep);
        rep->sync_ms += ms_since(t);
        if (rc != MPI_SUCCESS) {
            if (ulfm_is_failure(error_class(rc)))
                continue;
            return rc;
        }
        return MPI_SUCCESS;
    }
    return MPI_ERR_INTERN;
}

int ftc_recover(MPI_Comm *comm, int tag, ftc_report *rep)
{
    int rc = repair(comm, tag, rep);
    if (rc != MPI_SUCCESS)
        return fail(rep, rc);
    return finish(rep, rep->tag_min != rep->tag_max ? FTC_DIVERGED
                                                    : FTC_RECOVERED);
}

/* A collective run on a communicator; it must leave its inputs intact when
 * it fails, so that it can be run again on the repaired one. */
typedef int (*collective_fn)(void *args, MPI_Comm comm);

static int run_repairing(collective_fn run, void *args, MPI_Comm *comm,
                         int tag, ftc_report *rep)
{
    int recovered = 0;
    for (;;) {
        double t = MPI_Wtime();
        int rc = run(args, *comm);
        if (rc == MPI_SUCCESS) {
            if (recovered)
                rep->retry_ms = ms_since(t);
            return finish(rep, recovered ? FTC_RECOVERED : FTC_OK);
        }
        int cls = error_class(rc);
        if (!ulfm_is_failure(cls))
            return fail(rep, rc);
        note_failure(rep, cls, t);

        rc = repair(comm, tag, rep);
        if (rc != MPI_SUCCESS)
            return fail(rep, rc);
        recovered = 1;
        /* Some survivors may have completed this collective and moved on
         * (outcomes are not uniform): retrying now would mix two steps. */
        if (rep->tag_min != rep->tag_max)
            return finish(rep, FTC_DIVERGED);
    }
}

struct allreduce_args {
    const void *sendbuf;
    void *recvbuf;
    int count;
    MPI_Datatype datatype;
    MPI_Op op;
};

static int run_allreduce(void *p, MPI_Comm comm)
{
    struct allreduce_args *a = p;
    return MPI_Allreduce(a->sendbuf, a->recvbuf, a->count, a->datatype,
                         a->op, comm);
}

int ftc_allreduce(const void *sendbuf, void *recvbuf, int count,
                  MPI_Datatype datatype, MPI_Op op, MPI_Comm *comm,
                  int tag, ftc_report *rep)
{
    struct allreduce_args a = { sendbuf, recvbuf, count, datatype, op };
    return run_repairing(run_allreduce, &a, comm, tag, rep);
}

struct agree_args {
    int mine;
    int *flag;
};

static int run_agree(void *p, MPI_Comm comm)
{
    struct agree_args *a = p;
    *a->flag = a->mine;  /* a failed agree leaves the flag undefined */
    return MPIX_Comm_agree(comm, a->flag);
}

int ftc_agree(int *flag, MPI_Comm *comm, int tag, ftc_report *rep)
{
    struct agree_args a = { *flag, flag };
    return run_repairing(run_agree, &a, comm, tag, rep);
}

struct watchdog {
    double timeout_s;
    int exit_code;
};

static void *watchdog_main(void *p)
{
    struct watchdog *w = p;
    struct timespec ts = { (time_t)w->timeout_s,
                           (long)((w->timeout_s - (time_t)w->timeout_s) * 1e9) };
    while (nanosleep(&ts, &ts) != 0)
        ;
    _exit(w->exit_code);
    return NULL;
}

int ftc_finalize(double timeout_s, int exit_code)
{
    static struct watchdog w;
    pthread_t thread;
    w.timeout_s = timeout_s;
    w.exit_code = exit_code;
    if (pthread_create(&thread, NULL, watchdog_main, &w) == 0)
        pthread_detach(thread);
    return MPI_Finalize();
}
