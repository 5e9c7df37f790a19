# cython: language_level=3, boundscheck=False, wraparound=False
"""Bind the C fault path (csrc/ftcoll.c) to mpi4py communicators, the bounded
MPI_Init / MPI_Finalize (csrc/lifecycle.c) and the guard around Open MPI's revoke (csrc/revoke_guard.c)."""
from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release,
                             PyBUF_ANY_CONTIGUOUS, PyBUF_FORMAT, PyBUF_WRITABLE)
from libc.string cimport memset
from mpi4py cimport MPI
from mpi4py.libmpi cimport MPI_Comm, MPI_Count, MPI_Datatype

from mpi4py import MPI as _MPI
import signal as _signal

OK = FTC_OK
FAILED = FTC_FAILED
ERROR = FTC_ERROR
KILL_NONE = FTC_KILL_NONE
KILL_AFTER_REVOKE = FTC_KILL_AFTER_REVOKE
KILL_AFTER_SHRINK = FTC_KILL_AFTER_SHRINK
WEDGE_IN_REDUCTION = FTC_WEDGE_IN_REDUCTION
INIT_HANG_EXIT_CODE = FTC_INIT_HANG_EXIT


class FaultPathError(RuntimeError):
    """An MPI error that is not a process failure."""


# Calls of the fault path that returned: the hang watch (transport/hangs.py) tells a rank that waits for a
# peer from one whose collectives keep completing.
cdef unsigned long long _returned = 0


def progress():
    """How many calls of the fault path (reductions, broadcasts, agrees, repairs) have returned so far."""
    return _returned


cdef MPI_Datatype _datatype(Py_buffer *b) except *:
    return (<MPI.Datatype>MPI.Datatype.fromcode(b.format.decode())).ob_mpi


cdef inline void _count_return() noexcept:
    global _returned
    _returned += 1


def allreduce_try(MPI.Comm comm, sendbuf, recvbuf, MPI.Op op):
    """Reduce sendbuf into recvbuf once; on an error revoke comm. Return OK, FAILED or ERROR."""
    cdef Py_buffer sb, rb
    cdef MPI_Comm handle = comm.ob_mpi
    cdef MPI_Datatype dtype
    cdef MPI_Count count
    cdef int status
    PyObject_GetBuffer(sendbuf, &sb, PyBUF_ANY_CONTIGUOUS | PyBUF_FORMAT)
    try:
        PyObject_GetBuffer(recvbuf, &rb, PyBUF_ANY_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE)
        try:
            if sb.len != rb.len or <bytes>sb.format != <bytes>rb.format:
                raise ValueError("sendbuf and recvbuf must have the same size and type")
            if sb.buf == rb.buf:
                raise ValueError("sendbuf and recvbuf must be distinct buffers")
            dtype = _datatype(&sb)
            count = <MPI_Count>(sb.len // sb.itemsize)
            with nogil:
                status = ftc_allreduce_try(sb.buf, rb.buf, count, dtype, op.ob_mpi, handle)
            _count_return()
        finally:
            PyBuffer_Release(&rb)
    finally:
        PyBuffer_Release(&sb)
    return status


cdef enum:
    _BCAST, _SEND, _RECV


cdef int _transfer(int kind, MPI.Comm comm, buf, int peer, int tag) except -1:
    """One attempt of a broadcast from peer, a send to it or a receive from it; on an error revoke comm."""
    cdef Py_buffer b
    cdef MPI_Comm handle = comm.ob_mpi
    cdef MPI_Datatype dtype
    cdef MPI_Count count
    cdef int status
    PyObject_GetBuffer(buf, &b, PyBUF_ANY_CONTIGUOUS | PyBUF_FORMAT | (0 if kind == _SEND else PyBUF_WRITABLE))
    try:
        dtype = _datatype(&b)
        count = <MPI_Count>(b.len // b.itemsize)
        with nogil:
            if kind == _BCAST:
                status = ftc_bcast_try(b.buf, count, dtype, peer, handle)
            elif kind == _SEND:
                status = ftc_send_try(b.buf, count, dtype, peer, tag, handle)
            else:
                status = ftc_recv_try(b.buf, count, dtype, peer, tag, handle)
        _count_return()
    finally:
        PyBuffer_Release(&b)
    return status


def bcast_try(MPI.Comm comm, buf, int root):
    """Broadcast buf from root once; on an error revoke comm. Return OK, FAILED or ERROR."""
    return _transfer(_BCAST, comm, buf, root, 0)


def send_try(MPI.Comm comm, buf, int dest, int tag):
    """Send buf to dest once; on an error revoke comm. Return OK, FAILED or ERROR."""
    return _transfer(_SEND, comm, buf, dest, tag)


def recv_try(MPI.Comm comm, buf, int source, int tag):
    """Receive into buf from source once; on an error revoke comm. Return OK, FAILED or ERROR."""
    return _transfer(_RECV, comm, buf, source, tag)


def revoke(MPI.Comm comm):
    """Revoke comm, so that peers blocked on it leave for the commit agree."""
    cdef MPI_Comm handle = comm.ob_mpi
    with nogil:
        ftc_revoke(handle)


def status_of(int error_code):
    """Classify an MPI error code: OK, FAILED (a process failure) or ERROR."""
    return ftc_status_of(error_code)


def agree(MPI.Comm comm, int flag):
    """Return (AND of flag over the live ranks, OK or FAILED): both uniform on the survivors."""
    cdef MPI_Comm handle = comm.ob_mpi
    cdef int status
    with nogil:
        status = ftc_agree(handle, &flag)
    _count_return()
    return flag, status


def repair(MPI.Comm comm):
    """Revoke, shrink and agree; return the new communicator and the timings."""
    cdef ftc_report r
    cdef MPI_Comm handle = comm.ob_mpi
    cdef int status
    memset(&r, 0, sizeof(r))
    with nogil:
        status = ftc_repair(&handle, &r)
    _count_return()
    if status != FTC_OK:
        raise FaultPathError(_MPI.Get_error_string(r.mpi_error))
    cdef MPI.Intracomm fresh = MPI.Intracomm()
    fresh.ob_mpi = handle
    return fresh, {"revoke_ms": r.revoke_ms, "shrink_ms": r.shrink_ms,
                   "agree_ms": r.agree_ms, "shrinks": r.shrinks}


def set_max_chunk(Py_ssize_t elements):
    """Cap the elements one MPI call reduces (tests of the 64-bit path use a small cap)."""
    ftc_set_max_chunk(<MPI_Count>elements)


def set_killpoint(int point, int sig=_signal.SIGKILL):
    """Arm a signal (SIGKILL, or SIGSTOP to freeze) inside this process's next repair, or (WEDGE_IN_REDUCTION) a
    deadlock inside its next reduction (fault injection)."""
    ftc_set_killpoint(point, sig)


def init_bounded(double timeout):
    """MPI_Init_thread(MULTIPLE); if it has not returned after timeout seconds, one line on stderr
    and _exit(INIT_HANG_EXIT_CODE).  Return the thread level provided."""
    cdef int provided = 0
    cdef int rc
    with nogil:
        rc = ftc_init_bounded(timeout, &provided)
    if rc == FTC_EINVAL:
        raise ValueError(f"MPI_Init timeout must be a positive, finite number of seconds, got {timeout!r}")
    if rc == FTC_ENOTHREAD:
        raise RuntimeError("could not start the MPI_Init watchdog thread; MPI was not initialized")
    if rc != 0:
        raise FaultPathError(f"MPI_Init_thread failed with error code {rc}")
    return provided


def finalize(double timeout, int exit_code):
    """MPI_Finalize; if it has not returned after timeout seconds, one line on stderr and
    _exit(exit_code), which must be non-zero so that a hang never reads as success.

    Return MPI_Finalize's error code: after a failure it may report one, and there is nothing
    left to repair, so it is the caller's to log or ignore."""
    cdef int rc
    with nogil:
        rc = ftc_finalize(timeout, exit_code)
    if rc == FTC_EINVAL:
        if exit_code == 0:
            raise ValueError("finalize's hang exit code must be non-zero: a hang must not read as success")
        raise ValueError(f"finalize timeout must be a positive, finite number of seconds, got {timeout!r}")
    if rc == FTC_ENOTHREAD:
        raise RuntimeError("could not start the MPI_Finalize watchdog thread; MPI was not finalized")
    return rc


def guard_revoke():
    """Guard Open MPI's revoke of a communicator still being built (csrc/revoke_guard.h): 1 in place, 0 where
    it does not apply (another build), -1 when it could not be put in place."""
    return ftc_guard_revoke()


def guard_selftest():
    """Revoke a communicator whose collectives are not selected yet, as a failure reported during a split does:
    1 when it was revoked (MPI initialized); without the guard, Open MPI crashes."""
    return ftc_guard_selftest()
