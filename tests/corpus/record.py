"""Run a script of the corpus unchanged and write what its rank ended with: `python record.py RECORDS SCRIPT ARGS`.

The script runs as `python SCRIPT ARGS` would (runpy, as __main__, its folder first on sys.path).  Every
DistributedOptimizer and ExactlyOnceSampler it makes is noted as it is made; when the script returns, this rank
writes RECORDS/record<slot>.json: a CRC32 of every model's state_dict (parameters and buffers), every wrapped
optimizer's state_dict (its state and its param groups: a schedule's lr too), every tracked object's
state_dict and tracked value, computed here from the script's own objects (not the library's checksum, which
the end check uses), and the step counts, epochs, world history and whether this process took a dead slot.
A rank that raised, died or was never needed (a spare) writes nothing.  The script runs in RECORDS (its files
land there); `record<slot>.json` leaves the name `rank<slot>.json` to the scripts that write their own.
"""
from __future__ import annotations

import json
import os
import runpy
import sys
import zlib
from typing import Any

import numpy as np
import torch

import ulfmtrain

made: dict[str, list[Any]] = {"opts": [], "samplers": []}


def noting(cls: type, kind: str) -> None:
    init = cls.__init__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made[kind].append(self)

    cls.__init__ = __init__  # type: ignore[method-assign]


def crc_of(obj: Any, crc: int) -> int:
    """CRC32 of tensors, arrays and plain values, nested in dicts (by sorted key), lists and tuples."""
    if isinstance(obj, torch.Tensor):
        return zlib.crc32(obj.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes(), crc)
    if isinstance(obj, np.ndarray):
        return zlib.crc32(np.ascontiguousarray(obj).tobytes(), crc)
    if isinstance(obj, dict):
        for key in sorted(obj, key=str):
            crc = crc_of(obj[key], zlib.crc32(str(key).encode(), crc))
        return crc
    if isinstance(obj, (list, tuple)):
        for value in obj:
            crc = crc_of(value, crc)
        return crc
    return zlib.crc32(repr(obj).encode(), crc)


def record(out: str) -> None:
    opts, samplers = made["opts"], made["samplers"]
    if not opts:
        raise SystemExit("record.py: the script made no DistributedOptimizer")
    comm = opts[0].comm
    job = getattr(comm, "job", None)
    crc = 0
    for opt in opts:
        if opt.model is not None:
            crc = crc_of(opt.model.state_dict(), crc)
        crc = crc_of(opt.optimizer.state_dict(), crc)
    tracked = {} if job is None else {**{k: v.state_dict() for k, v in job.objects.items()}, **job.values}
    crc = crc_of(tracked, crc)
    rec = {"slot": comm.world_rank, "checksum": crc, "steps": [o.step_count for o in opts], "job_step": comm.step,
           "epochs": [s.epoch for s in samplers], "history": list(comm.world_history),
           "joined": getattr(comm, "takeover", None) is not None}
    with open(os.path.join(out, f"record{comm.world_rank}.json"), "w") as f:
        json.dump(rec, f)


def main() -> None:
    out, script, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    noting(ulfmtrain.DistributedOptimizer, "opts")
    noting(ulfmtrain.ExactlyOnceSampler, "samplers")
    out, script = os.path.abspath(out), os.path.abspath(script)
    os.chdir(out)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")
    record(out)


if __name__ == "__main__":
    main()
