#!/bin/bash
# The same job from a terminal: salloc takes the nodes and runs launch on this (the login) node, which is then
# the head: mpirun runs here, each rank is a job step on its node.  Ctrl-C stops everything and frees the nodes.
#   DATA=/shared/data examples/slurm/train-salloc.sh
# Output (every rank's, through srun) comes to this terminal; rank logs and summary.json go to OUT.
set -euo pipefail
PYTHON=${PYTHON:-python3}
DATA=${DATA:-/shared/data}
OUT=${OUT:-$PWD/runs/salloc-$(date +%Y%m%d-%H%M%S)}
NET=${NET:-}                         # the network that connects the nodes and this one; empty: found
exec salloc --nodes="${NODES:-2}" --ntasks-per-node="${TASKS_PER_NODE:-8}" --no-kill --time=01:00:00 \
    "$PYTHON" -P -m ulfmtrain launch --agent slurm ${NET:+--net "$NET"} --spares "${SPARES:-1}" -- \
    train --data "$DATA" --out "$OUT" --epochs "${EPOCHS:-5}" --ckpt-dir "$OUT/ckpt" --ckpt-every 200 ${TRAIN_ARGS:-}
