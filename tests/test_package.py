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
