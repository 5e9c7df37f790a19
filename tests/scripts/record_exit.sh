#!/bin/sh
# record_exit.sh OUT CMD...: run CMD as this rank's MPI process, write "STATUS END_TIME" to
# OUT/status.<rank>, then end as CMD did (a signal death is repeated on this shell), so that
# mpirun sees what it would have seen without the wrapper.  mpirun reports one exit code for
# the whole job; the tests need each rank's.
out=$1
shift
"$@"
status=$?
echo "$status $(date +%s.%N)" > "$out/status.$OMPI_COMM_WORLD_RANK.tmp"
mv "$out/status.$OMPI_COMM_WORLD_RANK.tmp" "$out/status.$OMPI_COMM_WORLD_RANK"
if [ "$status" -gt 128 ]; then
    kill -s "$(kill -l "$status")" $$
fi
exit "$status"
