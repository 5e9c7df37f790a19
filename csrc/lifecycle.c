/* MPI_Init and MPI_Finalize under a watchdog thread (see lifecycle.h).
 *
 * The watchdog waits on a condition variable with a deadline on the
 * monotonic clock: the call that completes in time wakes it and it ends
 * without a trace, so a bounded call costs nothing afterwards (a plain sleep
 * would _exit a process that is still running long after a finalize that
 * completed).  On the deadline it writes its line with write(2), no stdio
 * lock that the blocked thread might hold, and _exits: atexit handlers and
 * MPI's own clean-up would only block again. */
#include "lifecycle.h"

#include <mpi.h>

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Longer than any job; keeps the deadline inside time_t. */
#define FTC_MAX_TIMEOUT_S 1e9

struct watchdog {
    pthread_mutex_t lock;
    pthread_cond_t cond;        /* signalled when the guarded call returns */
    int done;
    struct timespec deadline;   /* CLOCK_MONOTONIC */
    int exit_code;
    char line[320];             /* formatted beforehand: the watchdog only writes it */
    size_t len;
};

static void *watchdog_main(void *p)
{
    struct watchdog *w = p;
    int rc = 0;
    pthread_mutex_lock(&w->lock);
    while (!w->done && rc == 0)     /* 0: a spurious wake-up, wait again */
        rc = pthread_cond_timedwait(&w->cond, &w->lock, &w->deadline);
    int fire = !w->done;
    pthread_mutex_unlock(&w->lock);
    if (fire) {
        ssize_t n = write(STDERR_FILENO, w->line, w->len);
        (void)n;                    /* nothing better to do if stderr is gone */
        _exit(w->exit_code);
    }
    return NULL;
}

static int valid_timeout(double timeout_s)
{
    return isfinite(timeout_s) && timeout_s > 0;
}

/* Start the watchdog; 0 on success. */
static int watchdog_start(struct watchdog *w, pthread_t *thread, double timeout_s)
{
    pthread_condattr_t attr;
    if (timeout_s > FTC_MAX_TIMEOUT_S)
        timeout_s = FTC_MAX_TIMEOUT_S;
    w->done = 0;
    w->len = strlen(w->line);
    clock_gettime(CLOCK_MONOTONIC, &w->deadline);
    time_t whole = (time_t)timeout_s;   /* positive and bounded: truncation is floor */
    w->deadline.tv_sec += whole;
    w->deadline.tv_nsec += (long)((timeout_s - (double)whole) * 1e9);
    if (w->deadline.tv_nsec >= 1000000000L) {
        w->deadline.tv_sec += 1;
        w->deadline.tv_nsec -= 1000000000L;
    }
    if (pthread_condattr_init(&attr) != 0)
        return -1;
    int rc = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    if (rc == 0)
        rc = pthread_cond_init(&w->cond, &attr);
    pthread_condattr_destroy(&attr);
    if (rc != 0)
        return -1;
    if (pthread_mutex_init(&w->lock, NULL) != 0) {
        pthread_cond_destroy(&w->cond);
        return -1;
    }
    if (pthread_create(thread, NULL, watchdog_main, w) != 0) {
        pthread_mutex_destroy(&w->lock);
        pthread_cond_destroy(&w->cond);
        return -1;
    }
    return 0;
}

/* The guarded call returned in time: wake the watchdog and wait for it to end. */
static void watchdog_stop(struct watchdog *w, pthread_t thread)
{
    pthread_mutex_lock(&w->lock);
    w->done = 1;
    pthread_cond_signal(&w->cond);
    pthread_mutex_unlock(&w->lock);
    pthread_join(thread, NULL);
    pthread_mutex_destroy(&w->lock);
    pthread_cond_destroy(&w->cond);
}

int ftc_init_bounded(double timeout_s, int *provided)
{
    struct watchdog w;
    pthread_t thread;
    int initialized = 0;
    int finalized = 0;
    if (!valid_timeout(timeout_s))
        return FTC_EINVAL;
    MPI_Initialized(&initialized);      /* both callable before MPI_Init and after MPI_Finalize */
    MPI_Finalized(&finalized);
    if (finalized)
        return MPI_ERR_OTHER;           /* MPI cannot be initialized twice */
    if (initialized)
        return MPI_Query_thread(provided);
    snprintf(w.line, sizeof w.line,
             "ulfmtrain: error: MPI_Init did not complete in %g s (a rank died during start-up?); "
             "the job is ended: rerun it, or raise ULFMTRAIN_INIT_TIMEOUT\n", timeout_s);
    w.exit_code = FTC_INIT_HANG_EXIT;
    if (watchdog_start(&w, &thread, timeout_s) != 0)
        return FTC_ENOTHREAD;
    int rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, provided);
    watchdog_stop(&w, thread);
    return rc;
}

int ftc_finalize(double timeout_s, int hang_exit_code)
{
    struct watchdog w;
    pthread_t thread;
    int initialized = 0, finalized = 0;
    if (!valid_timeout(timeout_s) || hang_exit_code == 0)
        return FTC_EINVAL;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (!initialized || finalized)
        return MPI_SUCCESS;             /* nothing to finalize (MPI_Finalize would be erroneous) */
    snprintf(w.line, sizeof w.line,
             "ulfmtrain: MPI_Finalize did not complete in %g s (it can hang after a process failure, "
             "ompi #11404); exiting with code %d\n", timeout_s, hang_exit_code);
    w.exit_code = hang_exit_code;
    if (watchdog_start(&w, &thread, timeout_s) != 0)
        return FTC_ENOTHREAD;
    int rc = MPI_Finalize();
    watchdog_stop(&w, thread);
    return rc;
}
