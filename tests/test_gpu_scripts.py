"""The GPU lease's scripts (benchmarks/*.sh) parse, and every flag they hand a benchmark exists.

A GPU is lent to a session for about 15 minutes, at most 10 a call. A flag renamed in a benchmark but
not in the script that calls it costs a call there, found only then. This reads each script's calls
of `benchmarks/*.py` (continuation lines joined, flags held in shell variables such as `$extra`
followed to their assignments) and checks the flags against each benchmark's own `--help`.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHELL_SCRIPTS = sorted((ROOT / "benchmarks").glob("*.sh"))
CALL = re.compile(r"benchmarks/([\w/]+\.py)")
FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")
ASSIGN = re.compile(r"(?:^|[\s;{])(\w+)=(\"[^\"]*\"|'[^']*'|\S+)")  # quoted or a bare word
VAR = re.compile(r"\$\{?(\w+)")
COMMAND_END = re.compile(r"&&|\|\||[;|>]")
SUBCOMMAND = re.compile(r"\s+([a-z][a-z0-9_]*)(?=\s|$)")  # a bare word right after the script


def invocations(text):
    """(benchmark path under benchmarks/ with its subcommand if any, flags) for every call of a benchmark in a
    shell script's text."""
    lines = [re.sub(r"(^|\s)#.*", "", line) for line in text.replace("\\\n", " ").splitlines()]
    held = {}  # shell variable -> the flags its assignments give it
    for line in lines:
        for name, value in ASSIGN.findall(line):
            held.setdefault(name, set()).update(FLAG.findall(value))
    for line in lines:
        for call in CALL.finditer(line):
            args = COMMAND_END.split(line[call.end() :], maxsplit=1)[0]
            flags = set(FLAG.findall(args))
            for name in VAR.findall(args):
                flags |= held.get(name, set())
            sub = SUBCOMMAND.match(args)  # `harness.py threads --flag`: the subcommand's own flags
            yield (f"{call[1]} {sub[1]}" if sub else call[1]), flags


def unknown_flags(calls, known):
    """The flags of ``calls`` ``(shell script, benchmark, flags)`` that the benchmark's --help does not name,
    as 'shell script: benchmark --flag' strings."""
    return sorted(f"{shell}: {script} {flag}" for shell, script, flags in calls for flag in flags - known[script])


@pytest.fixture(scope="module")
def calls():
    return [(path.name, *call) for path in SHELL_SCRIPTS for call in invocations(path.read_text())]


@pytest.fixture(scope="module")
def known(calls):
    """Each called benchmark's flags, read from its --help (the processes run side by side)."""
    procs = {
        script: subprocess.Popen(
            [sys.executable, str(ROOT / "benchmarks" / script.split()[0]), *script.split()[1:], "--help"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for script in sorted({script for _, script, _ in calls})
    }
    helps = {script: proc.communicate(timeout=120) for script, proc in procs.items()}
    for script, proc in procs.items():
        assert proc.returncode == 0, f"benchmarks/{script} --help: {helps[script][0][-500:]}"
    return {script: set(FLAG.findall(out)) for script, (out, _) in helps.items()}


@pytest.mark.parametrize("path", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_each_gpu_script_parses(path):
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_flag_a_gpu_script_gives_a_benchmark_is_one_it_takes(calls, known):
    # the lease's benchmarks are all read: the step rows, the runtime, the fuzz, the profile, dense's accuracy
    assert {script for _, script, _ in calls} >= {
        "train_step.py",
        "deploy_modes.py",
        "harnesses/search_fuzz.py",
        "gpu_profile.py",
        "accuracy.py",
        "harnesses/runtime_load.py threads",
    }
    by_script = {}
    for _, script, flags in calls:
        by_script.setdefault(script, set()).update(flags)
    # flags held in variables are followed: the graphed and engine-graph rows, onnxruntime's CUDA graph
    assert {"--cuda-graph", "--no-memory", "--engine-graph"} <= by_script["train_step.py"]
    assert {"--cuda-graph", "--cuda-arena", "--device", "--preset"} <= by_script["deploy_modes.py"]
    assert {"--kinds", "--out"} <= by_script["harnesses/search_fuzz.py"]  # a continuation line's flag
    bad = unknown_flags(calls, known)
    assert bad == [], f"flags the benchmarks do not take: {bad}"


def test_the_check_finds_a_renamed_flag_in_a_call_or_a_variable(known):
    text = (
        'extra=""\n[ "$mode" = graph ] && extra="--cuda-graf"\n[ "$mode" = e ] && extra=--engine-grap\n'
        "# a comment naming benchmarks/train_step.py --not-a-call\n"
        'timeout 5 $PY benchmarks/train_step.py --model "$1" $extra \\\n    --jsn out.json > log 2>&1\n'
        "$PY benchmarks/accuracy.py --suite x | tail -1 --lines\n"
        "$PY benchmarks/harnesses/runtime_load.py threads --input ortvalue --mixd\n"
    )
    assert unknown_flags([("t.sh", *call) for call in invocations(text)], known) == [
        "t.sh: harnesses/runtime_load.py threads --mixd",
        "t.sh: train_step.py --cuda-graf",
        "t.sh: train_step.py --engine-grap",
        "t.sh: train_step.py --jsn",
    ]
