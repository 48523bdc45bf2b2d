"""Build ``nwsconvert-runtime``: the wheel a robot installs to run bundles, without torch or timm.

    python export/dist/build_runtime.py --out dist
    # -> dist/nwsconvert_runtime-<version>-py3-none-any.whl  (make runtime-wheel)
    pip install nwsconvert_runtime-*.whl      # on the robot: onnxruntime-gpu (or onnxruntime), numpy, constriction, pillow

The wheel holds the modules listed in :data:`RUNTIME_MODULES`: ``Runtime``
(both modes), ``nws-infer``, the bundle reader and the torch-free task-pack
reader. Its dependencies are copied from the main ``pyproject.toml`` (same
version bounds, same onnxruntime-gpu / onnxruntime platform markers), so the
two distributions cannot drift apart.

It installs the same ``nwsconvert`` import package as the full distribution,
as onnxruntime and onnxruntime-gpu do: install one of the two per environment
(the full one already holds everything the runtime has). Asking the runtime
install for a training name (``nwsconvert.convert``...) raises an error that
says so.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: import package -> (source folder, modules). Everything ``Runtime``, ``nws-infer`` and the
#: bundle and pack readers import; tests/test_export.py::test_the_runtime_wheel_needs_neither_torch_nor_timm runs the installed wheel with
#: torch blocked, so a module missing here fails there.
RUNTIME_MODULES = {
    "nwsconvert": ("nwsconvert", ["__init__", "lazy", "errors", "devices"]),
    "nwsconvert.formats": ("nwsconvert/formats", ["__init__", "atomic", "limits", "schema", "stfile", "bitpack", "entropy", "rice", "changemap", "statecode", "indexcode", "packfile"]),
    "nwsconvert.conversion": ("nwsconvert/conversion", ["__init__", "config"]),
    "nwsconvert.train": ("nwsconvert/train", ["__init__", "rundir", "manifest"]),
    "nwsconvert.cli": ("nwsconvert/cli", ["__init__", "common"]),
    "nwsconvert.export": ("export", ["__init__", "bundlefile", "densify", "layout", "graphruns", "ortsetup", "frames", "sessionmode", "switchmode", "precision", "runtime", "timing", "cli"]),
}
#: the main distribution's dependencies the runtime keeps (by distribution name), plus Pillow for nws-infer's images.
#: onnx: the switch mode reads and edits the graph onnxruntime optimises for the machine (nwsconvert.export.layout).
KEEP = ("numpy", "constriction", "onnx", "onnxruntime", "onnxruntime-gpu")
EXTRA = ["pillow>=9"]


def library_version() -> str:
    """``nwsconvert.__version__``, read from its one place without importing the package."""
    text = (ROOT / "nwsconvert" / "__init__.py").read_text()
    found = re.search(r'^__version__ = "([^"]+)"$', text, re.M)
    if found is None:
        raise RuntimeError("nwsconvert/__init__.py has no __version__ line")
    return found.group(1)


def runtime_pyproject() -> str:
    """The runtime distribution's ``pyproject.toml``, derived from the main one."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    main = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = [d for d in main["dependencies"] if re.split(r"[<>=!~;\s\[]", d, maxsplit=1)[0].lower() in KEEP] + EXTRA
    lines = [
        "[build-system]",
        'requires = ["setuptools>=68"]',
        'build-backend = "setuptools.build_meta"',
        "",
        "[project]",
        'name = "nwsconvert-runtime"',
        f'version = "{library_version()}"',
        'description = "Run nwsconvert deployment bundles with onnxruntime, without torch: Runtime, nws-infer, bundle and pack readers."',
        f'requires-python = "{main["requires-python"]}"',
        "dependencies = [",
        *[f"    {json.dumps(d)}," for d in deps],
        "]",
        "",
        "[project.scripts]",
        'nws-infer = "nwsconvert.export.cli:infer_main"',
        "",
        "[tool.setuptools]",
        f"packages = {json.dumps(list(RUNTIME_MODULES))}",
    ]
    return "\n".join(lines) + "\n"


def build(out: Path) -> Path:
    """Stage the runtime modules and build the wheel into ``out``; returns its path."""
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp)
        for package, (folder, modules) in RUNTIME_MODULES.items():
            dst = stage.joinpath(*package.split("."))
            dst.mkdir(parents=True)
            for m in modules:
                shutil.copyfile(ROOT / folder / f"{m}.py", dst / f"{m}.py")
        (stage / "pyproject.toml").write_text(runtime_pyproject())
        code = "import sys, setuptools.build_meta as b; print(b.build_wheel(sys.argv[1]))"
        done = subprocess.run([sys.executable, "-c", code, str(out)], cwd=stage, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building the nwsconvert-runtime wheel failed:\n{done.stderr[-2000:]}")
        return out / done.stdout.strip().splitlines()[-1]


def main() -> None:
    p = argparse.ArgumentParser(description="Build the nwsconvert-runtime wheel (no torch, no timm).")
    p.add_argument("--out", default="dist", help="folder for the wheel (default: dist)")
    args = p.parse_args()
    print(build(Path(args.out)))


if __name__ == "__main__":
    main()
