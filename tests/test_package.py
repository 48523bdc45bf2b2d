"""The package as a user and a contributor meet it: its public names, its version, its layout."""

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import nwsconvert

ROOT = Path(__file__).resolve().parents[1]


def test_every_public_name_resolves_and_is_documented_in_the_readme():
    section = (ROOT / "README.md").read_text().split("## Python API", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(\w+)`", section))
    assert set(nwsconvert.__all__) <= documented, sorted(set(nwsconvert.__all__) - documented)
    for name in nwsconvert.__all__:
        assert getattr(nwsconvert, name) is not None
    assert "nearest_two" not in nwsconvert.__all__ and "brute_force" not in dir(nwsconvert)  # internals stay internal


def test_the_version_is_written_once():
    assert importlib.metadata.version("nwsconvert") == nwsconvert.__version__
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and nwsconvert.__version__ not in pyproject


def test_subpackages_import_without_torch():
    """The subpackages' __init__ modules, and what the torch-free runtime wheel ships, never load torch."""
    code = (
        "import sys; import nwsconvert.core, nwsconvert.conversion, nwsconvert.formats, nwsconvert.train, "
        "nwsconvert.analysis, nwsconvert.cli, nwsconvert.conversion.config, nwsconvert.train.rundir, "
        "nwsconvert.formats.packfile, nwsconvert.cli.common; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports, at any depth of its code (functions too), except
    under ``if TYPE_CHECKING:`` (annotations only, nothing imported at run time)."""
    import ast

    roots = {"nwsconvert": ROOT / "nwsconvert", "nwsconvert.export": ROOT / "export", "nwsconvert.zoo": ROOT / "zoo"}
    files = {}
    for package, folder in roots.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            files[".".join([package, *parts[:-1]] + ([] if parts[-1] == "__init__" else parts[-1:]))] = path
    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text())
        typing_only = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.dump(block.test)
            for n in ast.walk(block)
        }
        here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        deps = set()
        for node in ast.walk(tree):
            if id(node) in typing_only or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = ".".join(here[: len(here) - node.level + 1] + [node.module or ""]).strip(".")
                base = base if node.level else node.module or ""
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            deps.update(t for t in targets if t in files and t != module)
        graph[module] = deps
    return graph


def test_the_package_has_no_import_circles():
    """Data flows one way (ARCHITECTURE.md): no module imports, even lazily inside a function, a module
    that imports it back, directly or through others."""
    graph = _import_graph()
    assert "nwsconvert.core.engine" in graph and "nwsconvert.core.rounding" in graph["nwsconvert.core.search"]
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module, path):
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep) :] + [dep]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, [*path, dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
