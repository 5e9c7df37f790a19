# cython: language_level=3, boundscheck=False, wraparound=False
"""Bind the C fault path (csrc/ftcoll.c) to mpi4py communicators."""
from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release,
                             PyBUF_ANY_CONTIGUOUS, PyBUF_FORMAT, PyBUF_WRITABLE)
from libc.string cimport memset
from mpi4py cimport MPI
from mpi4py.libmpi cimport MPI_Comm

from mpi4py import MPI as _MPI

OK = FTC_OK
RECOVERED = FTC_RECOVERED
DIVERGED = FTC_DIVERGED
KILL_NONE = FTC_KILL_NONE
KILL_AFTER_REVOKE = FTC_KILL_AFTER_REVOKE
KILL_AFTER_SHRINK = FTC_KILL_AFTER_SHRINK


class FaultPathError(RuntimeError):
    """An MPI error that is not a process failure."""


cdef dict _report(ftc_report *r):
    rounds = []
    for i in range(min(r.nrounds, FTC_MAX_ROUNDS)):
        rounds.append({
            "size_after": r.rounds[i].size_after,
            "removed": [r.rounds[i].removed[j] for j in range(r.rounds[i].nremoved)],
        })
    return {
        "status": r.status, "error_class": r.error_class, "t_error": r.t_error,
        "detect_ms": r.detect_ms, "revoke_ms": r.revoke_ms,
        "shrink_ms": r.shrink_ms, "agree_ms": r.agree_ms,
        "sync_ms": r.sync_ms, "retry_ms": r.retry_ms,
        "tag_max": r.tag_max, "tag_min": r.tag_min, "root": r.root,
        "failed": [r.failed[i] for i in range(r.nfailed)],
        "rounds": rounds, "rounds_dropped": max(0, r.nrounds - FTC_MAX_ROUNDS),
    }


cdef object _finish(int status, MPI_Comm handle, ftc_report *r):
    if status == FTC_ERROR:
        raise FaultPathError(_MPI.Get_error_string(r.mpi_error))
    if status == FTC_OK:
        return status, None, None
    cdef MPI.Intracomm fresh = MPI.Intracomm()
    fresh.ob_mpi = handle
    return status, fresh, _report(r)


def allreduce(MPI.Comm comm, sendbuf, recvbuf, MPI.Op op, int tag):
    """Reduce sendbuf into recvbuf, repairing the communicator on failure."""
    cdef Py_buffer sb, rb
    cdef ftc_report r
    cdef MPI_Comm handle = comm.ob_mpi
    cdef int status, count
    PyObject_GetBuffer(sendbuf, &sb, PyBUF_ANY_CONTIGUOUS | PyBUF_FORMAT)
    try:
        PyObject_GetBuffer(recvbuf, &rb, PyBUF_ANY_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE)
        try:
            if sb.len != rb.len or <bytes>sb.format != <bytes>rb.format:
                raise ValueError("sendbuf and recvbuf must have the same size and type")
            if sb.buf == rb.buf:
                raise ValueError("sendbuf and recvbuf must be distinct buffers")
            dtype = MPI.Datatype.fromcode(sb.format.decode())
            count = <int>(sb.len // sb.itemsize)
            memset(&r, 0, sizeof(r))
            with nogil:
                status = ftc_allreduce(sb.buf, rb.buf, count, (<MPI.Datatype>dtype).ob_mpi,
                                       op.ob_mpi, &handle, tag, &r)
        finally:
            PyBuffer_Release(&rb)
    finally:
        PyBuffer_Release(&sb)
    return _finish(status, handle, &r)


def agree(MPI.Comm comm, int flag, int tag):
    """Agree on the bitwise AND of flag, repairing the communicator on failure."""
    cdef ftc_report r
    cdef MPI_Comm handle = comm.ob_mpi
    cdef int status
    memset(&r, 0, sizeof(r))
    with nogil:
        status = ftc_agree(&flag, &handle, tag, &r)
    return flag, _finish(status, handle, &r)


def recover(MPI.Comm comm, int tag):
    """Revoke, shrink and agree after a failure met elsewhere."""
    cdef ftc_report r
    cdef MPI_Comm handle = comm.ob_mpi
    cdef int status
    memset(&r, 0, sizeof(r))
    with nogil:
        status = ftc_recover(&handle, tag, &r)
    return _finish(status, handle, &r)


def finalize(double timeout, int exit_code):
    """MPI_Finalize under a watchdog that _exits with exit_code after timeout seconds."""
    with nogil:
        ftc_finalize(timeout, exit_code)


def set_killpoint(int point):
    """Arm a SIGKILL inside this process's next recovery (fault injection)."""
    ftc_set_killpoint(point)
