"""Print pip constraints that pin every dependency pyproject.toml declares with a lower bound to that bound.

    python3 .ci/min_constraints.py > min.txt && pip install -c min.txt -e '.[test]'

Used by ``make test-min``: the suite on the oldest releases the package says it supports. Runtime
dependencies and the ``test`` extra are pinned (``dev``'s tools are pinned exactly already); a
dependency whose marker does not apply to this machine is left out. Standard library + packaging (+ tomli on Python 3.10).
"""

from __future__ import annotations

import sys
from pathlib import Path

from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def lower_bounds(pyproject: Path = ROOT / "pyproject.toml", extras: tuple[str, ...] = ("test",)) -> list[str]:
    """``name==version`` for every requirement of ``dependencies`` and ``extras`` with a ``>=`` bound."""
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project.get("optional-dependencies", {}).get(extra, [])
    pins: dict[str, str] = {}
    for text in reqs:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate():
            continue
        low = [s.version for s in req.specifier if s.operator == ">="]
        if low:
            pins[req.name.lower()] = f"{req.name}=={low[0]}"
    return sorted(pins.values())


if __name__ == "__main__":
    sys.stdout.write("".join(line + "\n" for line in lower_bounds()))
