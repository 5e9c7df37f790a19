# Declarations of csrc/ftcoll.h and csrc/lifecycle.h (one block per C header).
from mpi4py.libmpi cimport MPI_Comm, MPI_Count, MPI_Datatype, MPI_Op

cdef extern from "ftcoll.h" nogil:
    enum:
        FTC_OK
        FTC_FAILED
        FTC_ERROR
        FTC_KILL_NONE
        FTC_KILL_AFTER_REVOKE
        FTC_KILL_AFTER_SHRINK
        FTC_WEDGE_IN_REDUCTION

    ctypedef struct ftc_report:
        int mpi_error
        double revoke_ms, shrink_ms, agree_ms
        int shrinks

    int ftc_status_of(int rc)
    int ftc_allreduce_try(const void *sendbuf, void *recvbuf, MPI_Count count,
                          MPI_Datatype datatype, MPI_Op op, MPI_Comm comm)
    int ftc_bcast_try(void *buf, MPI_Count count, MPI_Datatype datatype, int root, MPI_Comm comm)
    int ftc_send_try(const void *buf, MPI_Count count, MPI_Datatype datatype, int dest, int tag, MPI_Comm comm)
    int ftc_recv_try(void *buf, MPI_Count count, MPI_Datatype datatype, int source, int tag, MPI_Comm comm)
    void ftc_revoke(MPI_Comm comm)
    int ftc_agree(MPI_Comm comm, int *flag)
    int ftc_repair(MPI_Comm *comm, ftc_report *report)
    void ftc_set_max_chunk(MPI_Count elements)
    void ftc_set_killpoint(int point, int sig)

cdef extern from "lifecycle.h" nogil:
    enum:
        FTC_INIT_HANG_EXIT
        FTC_EINVAL
        FTC_ENOTHREAD

    int ftc_init_bounded(double timeout_s, int *provided)
    int ftc_finalize(double timeout_s, int hang_exit_code)

cdef extern from "revoke_guard.h" nogil:
    int ftc_guard_revoke()
    int ftc_guard_selftest()
