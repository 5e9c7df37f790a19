# Declarations of csrc/ftcoll.h (one .pxd per C header).
from mpi4py.libmpi cimport MPI_Comm, MPI_Datatype, MPI_Op

cdef extern from "ftcoll.h" nogil:
    enum:
        FTC_MAX_ROUNDS
        FTC_MAX_REMOVED
        FTC_OK
        FTC_RECOVERED
        FTC_DIVERGED
        FTC_ERROR
        FTC_KILL_NONE
        FTC_KILL_AFTER_REVOKE
        FTC_KILL_AFTER_SHRINK

    ctypedef struct ftc_round:
        int size_after
        int nremoved
        int removed[FTC_MAX_REMOVED]

    ctypedef struct ftc_report:
        int status
        int mpi_error
        int error_class
        double t_error
        double detect_ms, revoke_ms, shrink_ms, agree_ms, sync_ms, retry_ms
        int tag_max, tag_min, root
        int nfailed
        int failed[FTC_MAX_REMOVED]
        int nrounds
        ftc_round rounds[FTC_MAX_ROUNDS]

    int ftc_allreduce(const void *sendbuf, void *recvbuf, int count,
                      MPI_Datatype datatype, MPI_Op op, MPI_Comm *comm,
                      int tag, ftc_report *report)
    int ftc_agree(int *flag, MPI_Comm *comm, int tag, ftc_report *report)
    int ftc_recover(MPI_Comm *comm, int tag, ftc_report *report)
    int ftc_finalize(double timeout_s, int exit_code)
    void ftc_set_killpoint(int point)
