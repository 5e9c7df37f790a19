"""Which device a rank trains on: the slot, not the process, owns its GPU.

A slot (a logical rank, see spares.py) trains on cuda:(L % G), where L is the
local rank of the process that held the slot at launch (the agent's true
local rank under `launch --agent`) and G the GPUs on the host.  A spare or a
respawned process that takes a dead slot uses that slot's GPU; a waiting
spare holds no GPU.  One rank per GPU: launch G ranks per host.  Several per
GPU: launch k x G, and slots L, L + G, ... share GPU L.
"""
from __future__ import annotations

from typing import Any

import torch

from ..core.modes import Device, UsageError
from ..transport.lifecycle import local_rank  # (here too: where the device is picked)


def slot_local_rank(comm: Any) -> int:
    """The local rank that picks this process's device: its slot's at launch, else its own.

    comm.placement (gathered by the spare and respawn communicators at launch, and handed to each
    newcomer) lists the local rank of every launch rank; slot s was launch rank s.
    """
    placement, slot = getattr(comm, "placement", None), getattr(comm, "slot", None)
    if placement and slot is not None and 0 <= slot < len(placement):
        return int(placement[slot])
    return local_rank()


def cuda_missing() -> str | None:
    """Why CUDA cannot be used here (None: it can)."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"


def device_for(spec: Device | str, local: int | None = None) -> torch.device:
    """The device for `--device spec` at local rank `local` (default: this process's); touches no GPU.

    Raises UsageError for `cuda` where no GPU can be used: never a silent CPU run.
    """
    spec = Device(spec)
    if spec is Device.CPU or (spec is Device.AUTO and cuda_missing()):
        return torch.device("cpu")
    why = cuda_missing()
    if why:
        raise UsageError(f"--device cuda: {why}; run on a machine with an NVIDIA GPU and a CUDA build of torch, "
                         "or use --device cpu")
    return torch.device("cuda", (local_rank() if local is None else local) % torch.cuda.device_count())


def select_device(spec: Device | str, local: int | None = None) -> torch.device:
    """device_for(), made the current device (with CUDA)."""
    device = device_for(spec, local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # A spare must end where the failure-free run ends: cuDNN's default convolution backward is not
        # deterministic (atomics), and autotuning may pick different kernels in different processes.
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    return device


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's parameters (CPU for a model without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))
