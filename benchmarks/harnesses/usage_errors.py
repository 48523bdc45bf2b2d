"""How fast and how cleanly the command lines refuse bad input.

Runs every bad-input case of the reliability issue as a fresh process through the
installed console scripts (``nws-train``, ``nws-info``, ``nws-export``, ``nws-infer``),
as a user would type it, and prints per case: exit code, wall time, the lines on
stderr, and whether a traceback appeared. Targets: exit code 2, one line, no
traceback, under 2 s each.

    python benchmarks/harnesses/usage_errors.py [--rounds 3] [--run RUN] [--json out.json]

``--run`` is a finished run directory with an exported bundle (``RUN/export``), for the
nws-export / nws-infer cases that need one (skipped without it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _cases(tmp: Path, run: Path | None) -> list[tuple[str, list[str]]]:
    pack = tmp / "x.nwspack"
    pack.write_bytes(b"\0" * 16)
    afile = tmp / "afile"
    afile.write_text("x")
    out = f"out={tmp / 'run'}"
    train = [
        ["pool_size=abc", out],
        ["pool_size=1", out],
        ["tasks=abc", out],
        ["tasks=-1", out],
        ["device=gpu", out],
        ["device=cuda", out],
        ["seed=1.5", out],
        ["group_size=0", out],
        [f"init={tmp / 'missing.safetensors'}", out],
        [f"init={pack}", out],
        [f"out={afile}"],
        ["epochs=abc", out],
        ["lr=abc", out],
        ["milestones=5", out],
        ["learn_pools=abc", out],
        [f"weights={tmp / 'missing.safetensors'}", out],
        [f"weights={afile}", out],
        ["nope=1", out],
        ["model=resnet18", out],
        ["--resume"],
        ["--resume", f"out={tmp / 'never_started'}"],
        ["--resume", f"out={tmp}"],  # a folder that holds no run
        ["out="],
        ["model=timm:resnet_nope", out],  # these three import torch and timm to ask the registry or the suite
        ["model.nope=1", out],
        ["tasks=99", out],
    ]
    cases = [("nws-train", args) for args in train]
    cases += [
        ("nws-info", [str(afile)]),
        ("nws-info", [str(tmp / "none")]),
        ("nws-export", [str(afile), "--task", "0"]),
    ]
    cases += [("nws-report", [str(tmp / "none")]), ("nws-infer", ["--bundle", str(afile), "--task", "0"])]
    if run is not None:
        bundle = str(run / "export")
        cases += [
            ("nws-export", [str(run), "--task", "99"]),
            ("nws-infer", ["--bundle", bundle, "--task", "0", str(afile)]),
            ("nws-infer", ["--bundle", bundle, "--task", "0", str(tmp / "none.png")]),
            ("nws-infer", ["--bundle", bundle, "--task", "99"]),
            ("nws-infer", ["--bundle", bundle, "--task", "0", "-k", "0"]),
            ("nws-infer", ["--bundle", bundle, "--task", "0", str(tmp)]),  # a folder as an image
            ("nws-infer", ["--bundle", bundle, "--task", "0", "--cuda-graph", "--device", "cpu"]),
            ("nws-infer", ["--bundle", bundle, "--task", "0", "--cuda-graph", "--mode", "session"]),
            ("nws-report", [str(run), "--out", str(afile)]),
        ]
    return cases


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=3, help="runs of each case (the slowest is reported)")
    p.add_argument("--run", type=Path, default=None, help="a finished run with RUN/export, for the export/infer cases")
    p.add_argument("--json", type=Path, default=None, help="write the raw figures here")
    args = p.parse_args()
    bindir = Path(sys.executable).parent
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for prog, argv in _cases(Path(tmp), args.run):
            times, proc = [], None
            for _ in range(args.rounds):
                tic = time.perf_counter()
                proc = subprocess.run(
                    [str(bindir / prog), *argv], capture_output=True, text=True, env={**os.environ, "NWS_DEBUG": ""}
                )
                times.append(time.perf_counter() - tic)
            lines = proc.stderr.strip().splitlines()
            shown = " ".join(a.replace(tmp, "TMP") for a in argv)
            rows.append(
                {
                    "command": f"{prog} {shown}",
                    "rc": proc.returncode,
                    "seconds": max(times),
                    "lines": len(lines),
                    "traceback": "Traceback" in proc.stderr,
                    "message": (lines[0] if lines else "").replace(tmp, "TMP"),
                }
            )
    for r in rows:
        flag = (
            "" if r["rc"] == 2 and r["lines"] == 1 and not r["traceback"] and r["seconds"] < 2 else "  <-- off target"
        )
        print(f"{r['seconds']:5.2f} s  rc {r['rc']}  {r['command']}\n          {r['message'][:150]}{flag}")
    secs = [r["seconds"] for r in rows]
    ok = sum(r["rc"] == 2 and r["lines"] == 1 and not r["traceback"] for r in rows)
    print(
        f"\n{len(rows)} cases: {ok} one-line usage errors (exit 2), {sum(r['traceback'] for r in rows)} tracebacks; "
        f"slowest {max(secs):.2f} s, median {statistics.median(secs):.2f} s (slowest of {args.rounds} runs each)"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "machine": platform.platform(),
                    "python": platform.python_version(),
                    "cpus": os.cpu_count(),
                    "rows": rows,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
