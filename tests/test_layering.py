"""The package layering stays true: imports flow one way, and no module imports itself round a cycle.

Every module installed under `compress.*` (found through pyproject's package-dir map) is parsed, and
each import it makes, at module level or inside a function, is resolved to a module of ours. A module may
import from its own package, or from a package of a strictly lower layer; the algorithm packages form one
layer whose members may use each other, and import nothing of `compress/` except the error type.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

REPO = Path(__file__).resolve().parents[1]

# package -> layer; a module belongs to the longest package prefix of its name listed here
LAYERS = {
    "compress": 0,  # compress/__init__ (the version) and compress.errors
    "compress.quantizers": 1,
    "compress.pruners": 1,
    "compress.formats": 1,
    "compress.kernels": 1,
    "compress.checkpoints": 2,
    "compress.engine": 3,
    "compress.eval": 3,
    "compress.distill": 3,
    "compress.export": 4,
    "compress.run": 5,
    "compress.cli": 6,
}
ALGORITHMS = {name for name, layer in LAYERS.items() if layer == 1}  # one layer: they may import each other
ROOT_ALLOWED = {"compress", "compress.errors"}  # what every layer may import from compress/ itself


def package_of(module: str) -> str:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in LAYERS:
            return prefix
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS")


def installed_modules() -> dict[str, Path]:
    """Module name -> source file, for every module pyproject installs."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = config["package-dir"]
    modules = {}
    for package in config["packages"]:
        top = max((p for p in dirs if package == p or package.startswith(p + ".")), key=len)
        folder = REPO / dirs[top] / Path(*package[len(top) :].split(".")[1:] if package != top else ())
        for file in sorted(folder.glob("*.py")):
            name = package if file.stem == "__init__" else f"{package}.{file.stem}"
            modules[name] = file
    return modules


def imports_of(file: Path, module: str, known: set[str]) -> set[str]:
    """Our modules that ``file`` imports (``from pkg import submodule`` counts as the submodule)."""
    package = module if file.stem == "__init__" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import compress.x.y` names a module, not an attribute
                target = target.rpartition(".")[0]
            if target.startswith("compress") and target != module:
                found.add(target)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = installed_modules()
    assert "compress.engine.block_engine" in modules and "compress.quantizers.gptq" in modules
    return {name: imports_of(file, name, set(modules)) for name, file in modules.items()}


def allowed(source: str, target: str) -> bool:
    src, dst = package_of(source), package_of(target)
    if dst == "compress":
        return target in ROOT_ALLOWED
    if src == dst or (src in ALGORITHMS and dst in ALGORITHMS):
        return True
    return LAYERS[dst] < LAYERS[src]


def test_imports_flow_down_the_layers(graph):
    wrong = sorted(f"{s} imports {t}" for s, targets in graph.items() for t in targets if not allowed(s, t))
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_no_import_cycles(graph):
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt) :] + [node, nxt]) if nxt in path else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checker_sees_a_violation():
    """The rule itself: a lower layer importing a higher one is refused, the reverse allowed."""
    assert not allowed("compress.quantizers.gptq", "compress.engine.block_engine")
    assert not allowed("compress.engine.block_engine", "compress.run.runner")
    assert not allowed("compress.checkpoints.output", "compress.cli.console")
    assert not allowed("compress.eval.report", "compress.engine.statistics")  # same layer, other package
    assert allowed("compress.run.runner", "compress.engine.block_engine")
    assert allowed("compress.formats.base", "compress.quantizers.grid")
    assert allowed("compress.kernels.dispatch", "compress.errors")
    assert not allowed("compress.kernels.dispatch", "compress.checkpoints.output")


def test_every_module_imports_first():
    """Each module can be the first of the package imported (a cycle through a package's ``__init__`` fails only then,
    which the module graph above does not see). One child process; the package's modules are dropped between two."""
    import subprocess
    import sys

    script = (
        "import importlib, pkgutil, sys\n"
        "import compress\n"
        "names = [m.name for m in pkgutil.walk_packages(compress.__path__, 'compress.') if not m.name.endswith('__main__')]\n"
        "failed = []\n"
        "for name in names:\n"
        "    for loaded in [m for m in sys.modules if m == 'compress' or m.startswith('compress.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError as exc:\n"
        "        failed.append(f'{name}: {exc}')\n"
        "print('\\n'.join(failed))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd="/", timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "", "modules that cannot be imported first:\n" + done.stdout
