#!/usr/bin/env bash
# Slurm 22.05 and munge for tests/slurm (`make test-slurm`), from Debian's packages: only where they are missing,
# and only as root with apt-get.  Elsewhere it says why in one line and leaves it to the tests, which skip.
set -uo pipefail
need=(slurmctld slurmd srun munged)
missing=()
for b in "${need[@]}"; do command -v "$b" >/dev/null 2>&1 || missing+=("$b"); done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install_slurm.sh: ${missing[*]} missing and no apt-get as root here: the Slurm tests will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge; } \
        >/tmp/ulfmtrain-install-slurm.log 2>&1; then
    echo "install_slurm.sh: apt-get could not install Slurm (see /tmp/ulfmtrain-install-slurm.log):" \
         "the Slurm tests will skip" >&2
fi
exit 0
