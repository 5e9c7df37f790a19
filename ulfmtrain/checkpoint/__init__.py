"""Checkpoints that never corrupt, and the checkpointer that takes them at step boundaries.

- :mod:`.format`: the checkpoint file, the `latest` pointer, reading with fallback to the last good one.
- :mod:`.writer`: the background writer of the overlapped strategy.
- :mod:`.checkpointer`: :class:`Checkpointer` and the :class:`TrainingState` protocol it saves and restores.

Importing this package does not import torch or MPI: the supervisor reads pointers with it.

Layer 3, training (beside ulfmtrain.training).  The rule: a module here imports only from this layer and the
ones below (transport, core); the layers, lowest first, are ulfmtrain._LAYERS.
"""
from __future__ import annotations

from .checkpointer import (
    CheckpointComm,
    Checkpointer,
    TrainingState,
    capture,
    rng_state,
    set_rng_state,
)
from .format import (
    FORMAT,
    FORMAT_VERSION,
    LATEST,
    MAGIC,
    Checkpoint,
    CheckpointError,
    Snapshot,
    check_model,
    checkpoint_name,
    has_checkpoint,
    list_checkpoints,
    load_latest,
    model_signature,
    prune,
    read_checkpoint,
    read_pointer,
    remove_stale_temporaries,
    write_checkpoint,
)
from .writer import OverlappedWriter, WriteResult

__all__ = [
    "MAGIC", "FORMAT", "FORMAT_VERSION", "LATEST",
    "CheckpointError", "Snapshot", "Checkpoint", "checkpoint_name", "model_signature",
    "write_checkpoint", "prune", "remove_stale_temporaries", "read_checkpoint", "list_checkpoints",
    "read_pointer", "has_checkpoint", "load_latest", "check_model",
    "WriteResult", "OverlappedWriter",
    "CheckpointComm", "TrainingState", "Checkpointer", "capture", "rng_state", "set_rng_state",
]
