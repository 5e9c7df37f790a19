"""Lint and type checks are part of the test command: ruff (120 columns) and mypy, as pyproject.toml sets them."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
def test_ruff_is_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent))
    assert ruff, "ruff is missing: it comes with the test extra (pip install 'ulfmtrain[test]')"
    proc = subprocess.run([ruff, "check", "ulfmtrain", "tests", "benchmarks", "scripts"], cwd=ROOT, capture_output=True,
                          text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


@pytest.mark.timeout(300)
def test_mypy_is_clean():
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=290)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def _module_imports(path: Path, package: str) -> set[str]:
    """Modules of the package that `path` imports at its top level (imports inside functions are lazy)."""
    import ast

    tree = ast.parse(path.read_text())
    here = package.split(".")
    out = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[:len(here) - node.level + 1] if path.name == "__init__.py" else here[:len(here) - node.level]
            mod = ".".join(base + ([node.module] if node.module else []))
            names = [f"{mod}.{a.name}" for a in node.names]
            out.update(names if node.module is None else [mod, *names])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ulfmtrain"):
            out.add(node.module)
    return out


def test_no_import_cycles_and_no_long_modules():
    pkg = ROOT / "ulfmtrain"
    mods = {}
    for p in pkg.rglob("*.py"):
        rel = p.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if p.name == "__init__.py" else rel.parts)
        mods[name] = p
        assert len(p.read_text().splitlines()) <= 450, f"{p.relative_to(ROOT)} is over 450 lines: split it"
    graph = {m: {d for d in _module_imports(p, m if p.name == "__init__.py" else m.rsplit(".", 1)[0]) if d in mods}
             for m, p in mods.items()}
    # A package's __init__ importing its own submodules is not a cycle with them.
    graph = {m: {d for d in deps if d != m and not d.startswith(m + ".")} for m, deps in graph.items()}
    seen: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        seen[m] = 1
        for d in graph[m]:
            assert seen.get(d) != 1, "import cycle: " + " -> ".join(stack[stack.index(d):] + [d])
            if d not in seen:
                visit(d, stack + [d])
        seen[m] = 2

    for m in graph:
        if m not in seen:
            visit(m, [m])
