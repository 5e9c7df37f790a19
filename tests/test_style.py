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


def _layers() -> dict[str, int]:
    """Each package of ulfmtrain -> its layer's index, from the one place that orders them (ulfmtrain._LAYERS)."""
    import ast

    tree = ast.parse((ROOT / "ulfmtrain" / "__init__.py").read_text())
    (value,) = [n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "_LAYERS"]
    return {pkg: i for i, layer in enumerate(ast.literal_eval(value)) for pkg in layer}


def _module_imports(path: Path, package: str, mods: set[str]) -> set[str]:
    """Modules of the package that `path` imports anywhere: at its top, inside functions, under TYPE_CHECKING."""
    import ast

    here = package.split(".")
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:      # `from pkg import module` imports the module (and pkg, its ancestor)
                out.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out & mods


def test_layers_import_only_downward_with_no_cycle_and_no_long_modules():
    """No import cycle in the whole package, counting imports inside functions and under TYPE_CHECKING; each
    module imports only its own layer or lower (ulfmtrain._LAYERS); nothing but the entry points and the
    extension sits at the top level; each package's docstring states its layer and the rule."""
    import ast

    pkg = ROOT / "ulfmtrain"
    paths = {}
    for p in pkg.rglob("*.py"):
        rel = p.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if p.name == "__init__.py" else rel.parts)
        paths[name] = p
        assert len(p.read_text().splitlines()) <= 450, f"{p.relative_to(ROOT)} is over 450 lines: split it"
    mods = set(paths) | {"ulfmtrain._ftcoll"}
    layers = _layers()
    top = len(set(layers.values()))

    def layer(m: str) -> int:
        parts = m.split(".")
        if m == "ulfmtrain._ftcoll":
            return -1                  # the compiled fault path: below every layer
        if len(parts) == 1 or parts[1] in ("cli", "__main__"):
            return top                 # the entry points
        assert parts[1] in layers, f"{m} is in no layer: move it into one of the packages of ulfmtrain._LAYERS"
        return layers[parts[1]]

    for m, p in paths.items():
        layer(m)
        if p.name == "__init__.py" and m.count(".") == 1:
            assert "The rule:" in (ast.get_docstring(ast.parse(p.read_text())) or ""), \
                f"{p.relative_to(ROOT)}: its docstring must state its layer and the rule"
    graph = {}
    for m, p in paths.items():
        deps = _module_imports(p, m if p.name == "__init__.py" else m.rsplit(".", 1)[0], mods)
        # A package's __init__ importing its own submodules is not a cycle with them, nor is a module's
        # implicit import of the packages above it; but a public name of ulfmtrain itself comes from the top.
        graph[m] = {d for d in deps if d != m and not d.startswith(m + ".")
                    and not (m.startswith(d + ".") and d != "ulfmtrain")}
        for d in graph[m]:
            assert layer(d) <= layer(m), f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)}), a layer above it"
    seen: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        seen[m] = 1
        for d in sorted(graph.get(m, set())):
            assert seen.get(d) != 1, "import cycle: " + " -> ".join(stack[stack.index(d):] + [d])
            if d not in seen:
                visit(d, stack + [d])
        seen[m] = 2

    for m in sorted(graph):
        if m not in seen:
            visit(m, [m])
