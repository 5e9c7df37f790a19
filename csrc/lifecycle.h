/* Start-up and shut-down of MPI, each bounded by a watchdog thread.
 *
 * A rank that dies before MPI_Init completes leaves its peers waiting in
 * MPI_Init for ever (Open MPI's start-up fence has no timeout), and
 * MPI_Finalize after a failure can hang (ompi #11404, #9434).  In both cases
 * the process must end, non-zero and saying why, rather than wait.  The
 * watchdog is a C thread because the caller may hold a lock (Python's GIL)
 * meanwhile. */
#ifndef ULFMTRAIN_LIFECYCLE_H
#define ULFMTRAIN_LIFECYCLE_H

/* Exit status of a process whose MPI_Init did not complete in time. */
#define FTC_INIT_HANG_EXIT 3

/* Returned for arguments the call refuses (a timeout that is not a positive
 * finite number, a hang exit code of 0), and when the watchdog thread cannot
 * be started; MPI is then left untouched.  Both differ from every MPI error
 * code, which are non-negative. */
#define FTC_EINVAL (-1)
#define FTC_ENOTHREAD (-2)

/* MPI_Init_thread(MPI_THREAD_MULTIPLE); if it has not returned within
 * timeout_s, write one line on stderr and _exit(FTC_INIT_HANG_EXIT).
 * Returns MPI_Init_thread's code (MPI_SUCCESS without a call when MPI is
 * already initialized, MPI_ERR_OTHER when it was finalized), or FTC_EINVAL /
 * FTC_ENOTHREAD; *provided gets the thread level. */
int ftc_init_bounded(double timeout_s, int *provided);

/* MPI_Finalize; if it has not returned within timeout_s, write one line on
 * stderr and _exit(hang_exit_code), which must not be 0: a hang is never
 * reported as success.  Returns MPI_Finalize's code (MPI_SUCCESS without a
 * call when MPI is not initialized or already finalized), or FTC_EINVAL /
 * FTC_ENOTHREAD. */
int ftc_finalize(double timeout_s, int hang_exit_code);

#endif /* ULFMTRAIN_LIFECYCLE_H */
