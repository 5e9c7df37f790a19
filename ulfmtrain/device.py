"""Which device a rank trains on: its local rank on its host picks the GPU."""
from __future__ import annotations

import os

import torch

from .modes import Device, UsageError


def local_rank() -> int:
    """This rank's index among the ranks of its host.

    The agent launch exports the true value (Open MPI there believes every
    rank is on the head node); otherwise mpirun's OMPI_COMM_WORLD_LOCAL_RANK.
    """
    for var in ("ULFMTRAIN_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def cuda_missing() -> str | None:
    """Why CUDA cannot be used here (None: it can)."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"


def select_device(spec: Device | str) -> torch.device:
    """The device for `--device spec` on this rank; with CUDA, also make it the current device.

    Raises UsageError for `cuda` where no GPU can be used: never a silent CPU run.
    """
    spec = Device(spec)
    if spec is Device.CPU or (spec is Device.AUTO and cuda_missing()):
        return torch.device("cpu")
    why = cuda_missing()
    if why:
        raise UsageError(f"--device cuda: {why}; run on a machine with an NVIDIA GPU and a CUDA build of torch, "
                         "or use --device cpu")
    device = torch.device("cuda", local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's parameters (CPU for a model without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))
