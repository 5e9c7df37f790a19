"""The failure-free cost of the step transaction: one commit agree per step, as a ratio to a digits CNN step.

    python -P benchmarks/bench_commit.py [--ranks 4] [--steps 200]

Starts itself under mpirun --with-ft ulfm.  Each rank times, side by side in
one run: a whole FT-SGD step of the digits CNN (batch 16, forward, backward,
reduction, commit agree, update), and MPIX_Comm_agree alone on the same
communicator.  Writes benchmarks/results/commit.json and prints the ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "commit.json"


def rank_main(steps: int) -> None:
    import numpy as np
    import torch
    import torch.nn.functional as F

    from ulfmtrain import _ftcoll
    from ulfmtrain.comm import FaultTolerantComm
    from ulfmtrain.models import DigitsCNN
    from ulfmtrain.optim import FTSGD

    torch.set_num_threads(1)
    comm = FaultTolerantComm()
    model = DigitsCNN()
    opt = FTSGD(model.parameters(), comm, lr=0.01, momentum=0.9, model=model)
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step(samples=16)

    def agree() -> None:
        _ftcoll.agree(comm.comm, 1)

    result = {}
    for name, fn in (("step", step), ("agree", agree)):
        for _ in range(20):
            fn()
        times = []
        for _ in range(steps):
            comm.comm.Barrier()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        result[name] = float(np.median(times)) * 1e6
    med = comm.comm.gather(result, root=0)
    if comm.rank == 0:
        step_us = float(np.median([m["step"] for m in med]))
        agree_us = float(np.median([m["agree"] for m in med]))
        rec = {"ranks": comm.size, "steps": steps, "step_us": step_us, "agree_us": agree_us,
               "agree_over_step": agree_us / step_us}
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(rec, indent=2))
        print(f"{comm.size} ranks: step {step_us:.0f} us, commit agree {agree_us:.1f} us: "
              f"{100 * agree_us / step_us:.2f} % of a step")
    comm.finalize(3.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args()
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        rank_main(a.steps)
        return 0
    from ulfmtrain.launch import mpirun_prefix
    cmd = [*mpirun_prefix(a.ranks), sys.executable, "-P", __file__, "--steps", str(a.steps)]
    return subprocess.run(cmd, timeout=600).returncode


if __name__ == "__main__":
    sys.exit(main())
