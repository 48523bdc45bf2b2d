"""Reliability fuzzing of nwsconvert's readers: damaged, edited and swapped run files and bundles.

    python benchmarks/harnesses/fuzz.py --cases 20000 --seed 0 --work /tmp/nws-fuzz --out benchmarks/results/fuzz.json
    python benchmarks/harnesses/fuzz.py --cases 20000 --lib-rev e4104e2 --work /tmp/nws-fuzz-e4104e2   # a pinned library version
    python benchmarks/harnesses/fuzz.py --work /tmp/nws-fuzz --seed 0 --replay 1234     # one case again, verbosely

What it measures
----------------
Every case takes a fresh copy of a small real run directory (``manifest.json``,
``pools.safetensors``, ``base.nwspack``, ``tasks/task_<t>.nwspack``) or of its
ONNX bundle (``bundle.json``, ``pools.safetensors``, packs, ``task_<t>.onnx``),
applies ONE seeded mutation to ONE file, then calls ONE reader and classifies
what the reader did. Two tiny runs are trained once (``timm:test_resnet``, pool
size 32, 2 split-mnist tasks, seeds 1 and 2) and cached under ``--work``; every
case picks one as its subject and uses the other as the source of "foreign"
files. Case ``i`` depends only on ``(--seed, i)``: ``--replay i`` repeats it.

Mutations (the ``kind`` of a case; ``+rehash`` = the file's ``header_sha256``,
and for ``flip_data``/``st_json_edit`` also its content ``sha256``, are
recomputed afterwards, as a deliberate editor or a buggy writer would: this gets
past the self-checks and exercises the field checks and decoders behind them;
``+downgrade`` = version lowered and ``header_sha256`` deleted):

* byte level: ``flip_any`` (1-8 random bit flips anywhere), ``flip_st_header``
  (inside the safetensors header), ``flip_json_header`` (inside the nwsconvert
  JSON string of the header), ``flip_data`` (tensor bytes), ``truncate``,
  ``append``, ``empty``, ``random_bytes``, ``header_len`` (the 8-byte length
  prefix), ``st_repad`` (same header and tensors, header padded or rewritten, so
  the tensors sit at other absolute offsets: a valid file, as another writer
  would lay it out);
* JSON level (the nwsconvert header of packs and pool files, ``manifest.json``,
  ``bundle.json``): ``json_delete``, ``json_rename``, ``json_set`` (a random
  path set to a random JSON value: huge ints, negatives, strings, lists, null,
  NaN...), ``json_targeted`` (the fields readers depend on: layer count, changes,
  pool_size, shape, coding, num_classes, hashes, ``base.file`` = ``../x`` or
  ``/etc/passwd``, ``model.spec`` = ``subprocess:getoutput`` with a command that
  would create a sentinel file, task files pointing outside or at another task,
  bundle file names...), ``json_swap_rows`` (two task rows exchanged),
  ``st_json_edit`` (the safetensors tensor table: dtypes, shapes, offsets);
* files: ``swap:other_task`` / ``swap:base`` / ``swap:task`` (another file of the
  same run copied over it), ``swap:other_run`` (the other run's file),
  ``symlink:*`` (replaced by a link: to the other run's file, to the same file
  outside the copy, to /dev/zero, dangling), ``remove``.

Readers: ``manifest`` (``RunDir.read``), ``pool`` (``PoolSet.load``), ``pack``
(``TaskPack.load(path)``), ``pack_expect`` (``TaskPack.load`` with the
``sha256``/``pool_sha256``/``run_id``/``task`` the manifest or bundle.json
records), ``pack_dep`` (a task pack whose base was mutated), ``load``
(``nwsconvert.load``: state dict and logits on fixed inputs), ``summary``
(``run_summary``), ``analyse`` (``analyse_run``), ``export`` (``export_bundle``,
no ONNX), ``bundle`` (``read_bundle``), ``runtime`` (onnxruntime ``Runtime.run``).

How to read the outcomes
------------------------
``clear_error``
    an ``NWSError`` or ``FileNotFoundError`` whose message contains the basename
    of the mutated file. The goal for every damaged file.
``error_unnamed``
    the same exception types, but the message does not name the mutated file (it
    may name another one: ``named`` in the examples lists the files it names).
``identical``
    the reader succeeded and its result equals the unmutated one (packs: layer
    table, header fields, decoded indices and state bit for bit; pools: tensors;
    manifest/bundle: the dict; load: state dict and logits bit for bit; runtime:
    logits bit for bit). Harmless: the mutation hit bytes or fields nothing reads.
``silently_different``
    the reader succeeded with a different result. Examples carry ``expected``
    when that is by design: an unsigned JSON file (manifest.json, bundle.json)
    read back as edited, or a ``+rehash`` file read without any expectation.
    Every other one is a finding.
``raw_exception``
    any other exception: type, message, and ``site``, the innermost frame in
    nwsconvert's own code (``raised_at``: the innermost frame overall). A finding.
``resource``
    the case took longer than ``--slow`` seconds, the process's peak RSS grew by
    more than ``--rss-gib``, an allocation failed (``MemoryError``, torch's
    "can't allocate"), the per-case ``signal.alarm`` fired, or the supervisor's
    watchdog killed a case stuck in native code. A finding.
``crash``
    the worker process died during the case (signal, abort). A finding.
``harness_error``
    the mutation itself failed (a bug of this benchmark, not of nwsconvert).

Safety checks, reported apart: the sentinel file a ``subprocess:``/``os:`` model
spec would create never appears; an audit hook (``sys.addaudithook``) records
any file opened for writing, renamed or removed outside the case's scratch
folder and any process spawned while a reader runs; the cached source runs are
digested before and after; ``reads_outside`` lists (for information) files
opened for reading outside the scratch folder and the Python installation.

Runs as a supervisor (this process, idle) and one worker process that executes
the cases one at a time, writing one JSON line per case to
``WORK/cases.jsonl``; a worker that dies or hangs is restarted after the case.
Output: a table on stdout and the raw JSON (``--out``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
import traceback
import warnings
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# (folder, label) of nwsconvert's own code, for naming raise sites; set from the imported package (see lib_roots)
LIB_ROOTS: list[tuple[str, str]] = [(str(REPO / d) + os.sep, f"{d}/") for d in ("export", "zoo", "nwsconvert")]
OUTCOMES = (
    "clear_error",
    "error_unnamed",
    "identical",
    "silently_different",
    "raw_exception",
    "resource",
    "crash",
    "harness_error",
)
RUN_SEEDS = {"a": 1, "b": 2}
TASKS = (0, 1)
EXPORT_SNIPPET = "from nwsconvert.export.cli import export_main; import sys; sys.exit(export_main(sys.argv[1:]))"
SENTINEL_NAME = "SENTINEL_code_was_executed"


# ----------------------------------------------------------------------------- setup


def pin_library(rev: str, work: Path) -> tuple[str, Path]:
    """Make ``git archive REV`` of the library importable (an overlay on PYTHONPATH, for this process and its children).

    The repository maps ``export/`` and ``zoo/`` to ``nwsconvert.export`` and ``nwsconvert.zoo``; the overlay
    lays them out as subpackages, so the working tree can change while the benchmark runs.
    """
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", rev], capture_output=True, text=True, check=True
    ).stdout.strip()
    root = work / "lib" / commit[:12]
    pkg = root / "pkg"
    if not (pkg / "nwsconvert" / "export" / "runtime.py").is_file():
        shutil.rmtree(root, ignore_errors=True)
        (root / "src").mkdir(parents=True)
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", commit, "nwsconvert", "export", "zoo"], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(root / "src")], input=archive, check=True)
        shutil.copytree(root / "src" / "nwsconvert", pkg / "nwsconvert")
        shutil.copytree(root / "src" / "export", pkg / "nwsconvert" / "export")
        shutil.copytree(root / "src" / "zoo", pkg / "nwsconvert" / "zoo")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(pkg), *filter(None, [os.environ.get("PYTHONPATH")])])
    sys.path.insert(0, str(pkg))
    return commit, pkg


def library_digest(python: str) -> tuple[str, str]:
    """(folder of the nwsconvert a child process imports, SHA-256 of its .py files): a run whose library changes is flagged."""
    code = (
        "import nwsconvert, nwsconvert.export, nwsconvert.zoo, os, hashlib, json; h = hashlib.sha256(); "
        "dirs = sorted({os.path.dirname(m.__file__) for m in (nwsconvert, nwsconvert.export, nwsconvert.zoo)}); "
        "[h.update(open(os.path.join(r, f), 'rb').read()) for d in dirs for r, _, fs in sorted(os.walk(d)) for f in sorted(fs) if f.endswith('.py')]; "
        "print(json.dumps([dirs[0], h.hexdigest()]))"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True, cwd="/").stdout
    return tuple(json.loads(out))


def train_runs(work: Path, python: str, lib: str) -> dict[str, Path]:
    """The two cached runs (trained and exported on first use, ~15 s each on 2 cores), made by library ``lib``."""
    runs = {}
    marker = work / "runs" / "LIBRARY"
    if marker.is_file() and marker.read_text() != lib:
        shutil.rmtree(work / "runs")  # runs of another library version
    for name, seed in RUN_SEEDS.items():
        d = work / "runs" / name
        if not (
            (d / "manifest.json").is_file()
            and (d / "export" / "bundle.json").is_file()
            and (d / "export" / "task_1.onnx").is_file()
        ):
            shutil.rmtree(d, ignore_errors=True)
            d.parent.mkdir(parents=True, exist_ok=True)
            print(f"setup: training run {name} (seed {seed}) in {d}", flush=True)
            cmd = [
                python,
                "-m",
                "nwsconvert.cli.train",
                "model=timm:test_resnet",
                "pool_size=32",
                "pool_epochs=1",
                "epochs=1",
                f"tasks={len(TASKS)}",
                "progress=false",
                f"seed={seed}",
                f"out={d}",
            ]
            subprocess.run(cmd, check=True, cwd=work, stdout=subprocess.DEVNULL)
            subprocess.run(
                [python, "-c", EXPORT_SNIPPET, str(d), "--task", "all", "--onnx"],
                check=True,
                cwd=work,
                stdout=subprocess.DEVNULL,
            )
        runs[name] = d
    marker.write_text(lib)
    return runs


def tree_digest(root: Path) -> dict[str, str]:
    """Relative path -> SHA-256 of every file under ``root`` (links by their target text)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(root))] = "link:" + os.readlink(p)
        elif p.is_file():
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# ------------------------------------------------------------------ file formats


DTYPES = {
    "F64": "torch.float64",
    "F32": "torch.float32",
    "F16": "torch.float16",
    "BF16": "torch.bfloat16",
    "I64": "torch.int64",
    "I32": "torch.int32",
    "I16": "torch.int16",
    "I8": "torch.int8",
    "U64": "torch.uint64",
    "U32": "torch.uint32",
    "U16": "torch.uint16",
    "U8": "torch.uint8",
    "BOOL": "torch.bool",
    "F8_E4M3": "torch.float8_e4m3fn",
    "F8_E5M2": "torch.float8_e5m2",
}


def st_split(data: bytes) -> tuple[int, dict, bytes]:
    """(header length, outer header dict, tensor bytes) of a safetensors file."""
    (hlen,) = struct.unpack("<Q", data[:8])
    return hlen, json.loads(data[8 : 8 + hlen]), data[8 + hlen :]


def st_join(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


def header_digest(fields: dict) -> str:
    body = {k: v for k, v in fields.items() if k != "header_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def content_digest(header: dict, body: bytes) -> str:
    """The content SHA-256 nwsconvert records (names in order; name, torch dtype, shape, bytes)."""
    h = hashlib.sha256()
    for name in sorted(k for k in header if k != "__metadata__"):
        t = header[name]
        start, end = t["data_offsets"]
        h.update(json.dumps([name, DTYPES.get(t["dtype"], str(t["dtype"])), list(t["shape"])]).encode())
        h.update(body[start:end])
    return h.hexdigest()


def resign(data: bytes, content: bool) -> bytes:
    """Recompute header_sha256 (and the content sha256 when ``content``) of an nwsconvert safetensors file."""
    _, header, body = st_split(data)
    meta = json.loads(header["__metadata__"]["nwsconvert"])
    if content:
        meta["sha256"] = content_digest(header, body)
    meta["header_sha256"] = header_digest(meta)
    header["__metadata__"]["nwsconvert"] = json.dumps(meta, sort_keys=True)
    return st_join(header, body)


def json_string_span(data: bytes) -> tuple[int, int] | None:
    """Byte range of the nwsconvert JSON string inside a safetensors header."""
    key = b'"nwsconvert":"'
    start = data.find(key)
    if start < 0:
        return None
    start += len(key)
    i = start
    while i < len(data):
        if data[i] == 0x5C:  # backslash: skip the escaped character
            i += 2
            continue
        if data[i] == 0x22:
            return start, i
        i += 1
    return None


# ------------------------------------------------------------------- JSON editing


def json_paths(obj, prefix=()) -> list[tuple]:
    out = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        out.append((*prefix, k))
        out += json_paths(v, (*prefix, k))
    return out


def show_path(path) -> str:
    text = ""
    for k in path:
        text += f"[{k}]" if isinstance(k, int) else (f".{k}" if text else str(k))
    return text or "<root>"


def get_at(obj, path):
    for k in path:
        obj = obj[k]
    return obj


def apply_ops(obj, ops) -> None:
    """Apply ``("set", path, value)``, ``("del", path)``, ``("rename", path, new_key)`` in place."""
    for op in ops:
        path = op[1]
        parent = get_at(obj, path[:-1])
        key = path[-1]
        if op[0] == "set":
            if isinstance(parent, list) and key >= len(parent):
                parent.append(op[2])
            else:
                parent[key] = op[2]
        elif op[0] == "del":
            del parent[key]
        elif op[0] == "rename":
            parent[op[2]] = parent.pop(key)


HUGE = [10**6, 10**7, 10**8, 10**9, 10**10, 10**11, 10**12, 2**31, 2**32, 2**62, 2**63, 2**64]


def random_value(rng: random.Random, cur):
    """A random JSON value, sometimes near ``cur``."""
    pick = rng.randrange(15)
    if pick == 0:
        return rng.choice(HUGE)
    if pick == 1:
        return -rng.choice([1, 2, 7, 10**6, 2**62, 2**63])
    if pick == 2:
        return 0
    if pick == 3:
        return cur + rng.choice([-1, 1, 2, -2]) if type(cur) is int else rng.randint(-3, 100)
    if pick == 4:
        return cur * rng.choice([2, 10, 1000]) if type(cur) is int else 1.5
    if pick == 5:
        return rng.choice([0.5, -0.0, 1e308, float("nan"), float("inf"), 3.0])
    if pick == 6:
        return rng.choice(["", "x", "0", "../x", "/etc/passwd", "\u00e9", "\u0000", "a" * 5000, "NaN", "true"])
    if pick == 7:
        return cur + rng.choice(["x", " ", "/"]) if isinstance(cur, str) else "y"
    if pick == 8:
        return rng.choice([[], [1, 2, 3], [[1]], ["a"], [None], [2**62] * 4, [10**12, 10**12]])
    if pick == 9 and isinstance(cur, list) and cur:
        c = list(cur)
        what = rng.randrange(3)
        if what == 0:
            c.pop(rng.randrange(len(c)))
        elif what == 1:
            c.insert(rng.randrange(len(c) + 1), rng.choice(c))
        else:
            c[rng.randrange(len(c))] = random_value(rng, None)
        return c
    if pick == 10:
        return rng.choice([{}, {"a": 1}, {"format": "x"}])
    if pick == 11:
        return None
    if pick == 12:
        return rng.choice([True, False])
    if pick == 13 and isinstance(cur, str):
        return cur[:-1] if cur else "z"
    return rng.choice([str(cur)[:40], [cur], {"v": cur}])


def rename_key(rng: random.Random, key: str, siblings) -> str:
    others = [k for k in siblings if k != key]
    choices = [key + "_", key.upper() if key.upper() != key else key + "X", key[:-1] or "_", "", " " + key]
    if others:
        choices.append(rng.choice(others))
    return rng.choice(choices)


# ---------------------------------------------------------------- case context


class Subject:
    """One source run (pristine files in memory) and what its readers return unmutated."""

    def __init__(self, name: str, run: Path):
        self.name, self.src = name, run
        self.files: dict[str, bytes] = {}
        for rel in ("manifest.json", "pools.safetensors", "base.nwspack", *(f"tasks/task_{t}.nwspack" for t in TASKS)):
            self.files[f"run/{rel}"] = (run / rel).read_bytes()
        for p in sorted((run / "export").iterdir()):
            if p.is_file():
                self.files[f"bundle/{p.name}"] = p.read_bytes()
        self.manifest = json.loads(self.files["run/manifest.json"])
        self.bundle = json.loads(self.files["bundle/bundle.json"])
        self.refs: dict = {}

    def src_path(self, rel: str) -> Path:
        kind, _, name = rel.partition("/")
        return self.src / name if kind == "run" else self.src / "export" / name

    def pack_sha(self, rel: str) -> str:
        _, header, _ = st_split(self.files[rel])
        return json.loads(header["__metadata__"]["nwsconvert"])["sha256"]


class Case:
    def __init__(self, i: int, subject: str, target: str, kind: str, reader: str, task: int):
        self.i, self.subject, self.target, self.kind, self.reader, self.task = i, subject, target, kind, reader, task
        self.mutation: dict = {}

    @property
    def basename(self) -> str:
        return self.target.rsplit("/", 1)[-1]


# ------------------------------------------------------------------- case plan

# target -> (weight, format, reader weights)
TARGETS = {
    "run/manifest.json": (7, "json", {"manifest": 4, "load": 4, "summary": 1, "analyse": 1, "export": 1}),
    "run/pools.safetensors": (4, "pool", {"pool": 5, "load": 3, "summary": 1, "analyse": 1, "export": 1}),
    "run/base.nwspack": (
        5,
        "pack",
        {"pack": 3, "pack_expect": 2, "pack_dep": 3, "load": 3, "summary": 1, "analyse": 1, "export": 1},
    ),
    "run/tasks/task_0.nwspack": (
        5,
        "pack",
        {"pack": 3, "pack_expect": 3, "load": 3, "summary": 1, "analyse": 1, "export": 1},
    ),
    "run/tasks/task_1.nwspack": (
        5,
        "pack",
        {"pack": 3, "pack_expect": 3, "load": 3, "summary": 1, "analyse": 1, "export": 1},
    ),
    "bundle/bundle.json": (4, "json", {"bundle": 3, "runtime": 3, "switch": 3}),
    "bundle/pools.safetensors": (3, "pool", {"pool": 2, "runtime": 3, "switch": 2}),
    "bundle/task_0.onnx": (2, "onnx", {"runtime": 1}),
    "bundle/task_1.onnx": (2, "onnx", {"runtime": 1}),
    "bundle/switch.onnx": (2, "onnx", {"switch": 1}),
    "bundle/task_0.nwspack": (2, "pack", {"pack": 1, "pack_expect": 1, "switch": 2}),
    "bundle/task_1.nwspack": (2, "pack", {"pack": 1, "pack_expect": 1, "switch": 2}),
    "bundle/base.nwspack": (2, "pack", {"pack": 1, "pack_expect": 1, "pack_dep": 2, "switch": 2}),
}
ST_KINDS = {
    "flip_any": 6,
    "flip_st_header": 4,
    "flip_json_header": 5,
    "flip_data": 5,
    "flip_data+rehash": 4,
    "truncate": 5,
    "append": 3,
    "empty": 1,
    "random_bytes": 2,
    "header_len": 2,
    "st_repad": 2,
    "st_json_edit": 4,
    "st_json_edit+rehash": 3,
    "json_delete": 3,
    "json_rename": 2,
    "json_set": 5,
    "json_targeted": 6,
    "json_delete+rehash": 3,
    "json_rename+rehash": 2,
    "json_set+rehash": 5,
    "json_targeted+rehash": 9,
    "json_targeted+downgrade": 2,
    "swap:other_run": 3,
    "symlink:other_run": 1,
    "symlink:same_outside": 1,
    "symlink:dev_zero": 1,
    "symlink:dangling": 1,
    "remove": 1,
}
PACK_SWAPS = {"run/base.nwspack": {"swap:task": 3}, "bundle/base.nwspack": {"swap:task": 3}}
JSON_KINDS = {
    "flip_any": 5,
    "truncate": 3,
    "append": 2,
    "empty": 1,
    "random_bytes": 1,
    "json_delete": 5,
    "json_rename": 3,
    "json_set": 6,
    "json_targeted": 14,
    "json_swap_rows": 3,
    "swap:other_run": 2,
    "symlink:dev_zero": 1,
    "remove": 1,
}
ONNX_KINDS = {
    "flip_any": 5,
    "truncate": 3,
    "append": 2,
    "empty": 1,
    "random_bytes": 1,
    "swap:other_task": 2,
    "swap:other_run": 2,
    "remove": 1,
}
HEAVY = ("load", "runtime", "switch", "summary", "analyse", "export")


def weighted(rng: random.Random, table: dict):
    keys = list(table)
    return rng.choices(keys, weights=[table[k] for k in keys])[0]


def plan_case(seed: int, i: int, heavy: float) -> tuple[Case, random.Random]:
    rng = random.Random(f"nws-fuzz:{seed}:{i}")
    subject = rng.choice(sorted(RUN_SEEDS))
    target = weighted(rng, {t: w for t, (w, _, _) in TARGETS.items()})
    _, fmt, readers = TARGETS[target]
    if fmt in ("pack", "pool"):
        kinds = dict(ST_KINDS)
        if fmt == "pack":
            kinds.update(PACK_SWAPS.get(target, {"swap:other_task": 3, "swap:base": 2}))
        else:
            kinds["swap:pack"] = 1
    else:
        kinds = JSON_KINDS if fmt == "json" else ONNX_KINDS
        if target == "bundle/switch.onnx":  # one per bundle: no other task's to swap in
            kinds = {k: w for k, w in kinds.items() if k != "swap:other_task"}
    kind = weighted(rng, kinds)
    readers = {r: w * (heavy if r in HEAVY else 1.0) for r, w in readers.items()}
    if kind.startswith(("swap:", "symlink:")) and "pack" in readers:
        readers.pop("pack")  # a swapped pack is only detectable against what the caller expects
    reader = weighted(rng, readers)
    m = re.search(r"task_(\d)\.", target)
    task = int(m.group(1)) if m and rng.random() < 0.85 else rng.choice(TASKS)
    return Case(i, subject, target, kind, reader, task), rng


# ------------------------------------------------------------------- mutations


def flip_bits(rng: random.Random, data: bytes, lo: int, hi: int) -> tuple[bytes, list]:
    buf = bytearray(data)
    hi = min(hi, len(buf))
    if hi <= lo:
        return data, []
    flips = []
    for _ in range(rng.randint(1, 8)):
        pos, bit = rng.randrange(lo, hi), rng.randrange(8)
        buf[pos] ^= 1 << bit
        flips.append((pos, bit))
    return bytes(buf), flips


def targeted_pack(rng: random.Random, meta: dict, case: Case, subj: Subject, other: Subject, rehash: bool) -> list:
    """Edits of the fields a pack reader depends on."""
    layers = meta.get("layers") or []
    ops = []
    if layers and rng.random() < 0.6:
        delta = [j for j, r in enumerate(layers) if isinstance(r, dict) and r.get("changes")]
        i = rng.choice(delta) if delta and rng.random() < 0.5 else rng.randrange(len(layers))
        row = layers[i]
        cnt = row.get("count", 1) if type(row.get("count")) is int else 1
        shape = row.get("shape") if isinstance(row.get("shape"), list) else [1]
        ch = row.get("changes") if type(row.get("changes")) is int else 0
        names = [r.get("name") for r in layers if isinstance(r, dict)]
        field = rng.choice(
            [
                "count",
                "changes",
                "pool_size",
                "shape",
                "coding",
                "mask",
                "bits",
                "vector_size",
                "name",
                "role",
                "groups",
                "pool",
            ]
        )
        values = {
            "count": [*rng.sample(HUGE, 3), -1, 0, cnt + 1, cnt - 1, cnt * 2, str(cnt), float(cnt), None],
            "changes": [0, cnt, cnt + 1, ch + 1, max(0, ch - 1), -1, 10**9, 2**62, None, "1"],
            "pool_size": [*rng.sample(HUGE, 2), 0, 1, 2, 17, 31, 33, 64, 2**24, 2**24 + 1, -32, None],
            "bits": [0, 1, 4, 6, 33, 64, -5, None],
            "vector_size": [0, 1, 3, 18, 2**16, 2**16 + 1, 10**9, None],
            "shape": [
                [10**6],
                [2**62],
                [],
                [0],
                [shape[0] * 2, *shape[1:]],
                shape[::-1],
                [shape],
                [-1, *shape[1:]],
                "3x3",
                None,
                shape[:-1],
                [*shape, 1],
                [2**31] * 4,
                [1, 2, 3, 4, 5, 6, 7],
            ],
            "coding": [c for c in ("bits", "ans", "delta+bits", "delta+ans") if c != row.get("coding")]
            + ["zip", None, 7, ""],
            "mask": [m for m in ("rice", "ans") if m != row.get("mask")] + ["gaps", None, 1, ""],
            "name": [rng.choice(names), "", "x", None, f"{row.get('name')}x"],
            "role": ["head", "stem", "body", "shortcut", "tail", None],
            "groups": [0, 2, 10**9, -1, None],
            "pool": ["", "fc", None],
        }[field]
        ops.append(("set", ("layers", i, field), rng.choice(values)))
        if field in ("count", "pool_size") and rng.random() < 0.3:  # keep the cross-field checks satisfied
            v = ops[-1][2]
            if field == "pool_size" and type(v) is int and v > 0:
                ops.append(("set", ("layers", i, "bits"), max(1, (v - 1).bit_length())))
            if field == "count" and type(v) is int and v > 0 and type(row.get("vector_size")) is int:
                ops.append(("set", ("layers", i, "shape"), [v * row["vector_size"]]))
        if rng.random() < 0.1 and field in row:
            ops = [("del", ("layers", i, field))]
        return ops
    sha = meta.get("sha256") if isinstance(meta.get("sha256"), str) else "0" * 64
    other_rel = case.target if case.target in other.files else "run/base.nwspack"
    nc = meta.get("num_classes") if type(meta.get("num_classes")) is int else 2
    keys = meta.get("state_keys") if isinstance(meta.get("state_keys"), list) else []
    sk = [keys[1:], [*keys, keys[0]] if keys else ["x"], [*keys, "state/x"], [], None, list(reversed(keys))]
    coded = meta.get("state_delta") if isinstance(meta.get("state_delta"), list) else []
    sd = [coded[1:], [*coded, coded[0]] if coded else keys[:1], keys, [], None, ["x"], [5], "x", list(reversed(coded))]
    fields = {
        "num_classes": [*rng.sample(HUGE, 2), 0, -1, nc + 1, None, "2", 10],
        "sha256": ["0" * 64, other.pack_sha(other_rel), sha.upper(), sha[:-1], "", None, 5],
        "pool_sha256": [other.manifest["pools"]["sha256"], "0" * 64, None],
        "base.file": [
            "../x",
            "/etc/passwd",
            "../base.nwspack",
            "task_1.nwspack",
            "nope.nwspack",
            "",
            ".",
            "..",
            "a\\b",
            "C:x",
            "tasks/base.nwspack",
            "base.nwspack\u0000",
            None,
            5,
        ],
        "base.sha256": [other.manifest["base"]["sha256"], sha, "0" * 64, None],
        "base": [None, {}, "base.nwspack", {"sha256": subj.manifest["base"]["sha256"]}],
        "run_id": [other.manifest.get("run_id"), "", None, 5],
        "task": [1 - case.task, 1, -1, 10**12, "0", None, 0.5, True],
        "state_keys": sk,
        "state_delta": sd,
        "version": [0, 1, 2, 4, 5, 6, 99, "3", None, 3.0, -1, 2**63],
        "format": ["nwsconvert.poolset", "nwsconvert.taskpack", "nwsconvert.run", "x", None],
        "meta": [None, [], "x", {"task": 5}],
        "model_spec": ["subprocess:getoutput", None, 5],
    }
    if not rehash:
        fields["header_sha256"] = ["0" * 64, None, "", 7, header_digest({"x": 1})]
    name = rng.choice(list(fields))
    path = tuple(name.split("."))
    if path[0] == "base" and len(path) > 1 and not isinstance(meta.get("base"), dict):
        path = ("base",)
        return [("set", path, {"file": rng.choice(fields["base.file"]), "sha256": subj.manifest["base"]["sha256"]})]
    if rng.random() < 0.1 and path[0] in meta:
        return [("del", path)]
    return [("set", path, rng.choice(fields[name]))]


def targeted_pool(rng: random.Random, meta: dict, other: Subject, rehash: bool) -> list:
    layers = meta.get("layers") or []
    if layers and rng.random() < 0.6:
        i = rng.randrange(len(layers))
        row = layers[i] if isinstance(layers[i], dict) else {}
        field = rng.choice(["name", "pool_size", "vector_size", "row"])
        if field == "row":
            what = rng.randrange(3)
            if what == 0:
                return [("del", ("layers", i))]
            if what == 1:
                return [("set", ("layers", len(layers)), dict(row))]
            j = rng.randrange(len(layers))
            return [("set", ("layers", i), layers[j]), ("set", ("layers", j), row)]
        names = [r.get("name") for r in layers if isinstance(r, dict)]
        n = row.get("pool_size", 32) if type(row.get("pool_size")) is int else 32
        values = {
            "name": [rng.choice(names), "", None, "x"],
            "pool_size": [n + 1, n - 1, 0, 1, *rng.sample(HUGE, 2), -n, None, str(n)],
            "vector_size": [0, 1, 2, 10**9, 2**16 + 1, None],
        }[field]
        return [("set", ("layers", i, field), rng.choice(values))]
    fields = {
        "sha256": ["0" * 64, other.manifest["pools"]["sha256"], None, 5],
        "version": [0, 1, 3, 99, "2", None],
        "format": ["nwsconvert.taskpack", "x", None],
        "layers": [[], None, {}, "x"],
    }
    if not rehash:
        fields["header_sha256"] = ["0" * 64, None, ""]
    name = rng.choice(list(fields))
    return [("set", (name,), rng.choice(fields[name]))]


def targeted_manifest(rng: random.Random, m: dict, case: Case, subj: Subject, other: Subject, sentinel: Path) -> list:
    tasks = m.get("tasks") or []
    t = rng.randrange(len(tasks)) if tasks else 0
    o = 1 - t
    group = rng.choice(["spec", "spec", "kwargs", "convert", "file", "file", "task", "task", "pools", "base", "top"])
    if group == "spec":
        code = [
            ("subprocess:getoutput", {"cmd": f"touch {sentinel}"}),
            ("os:system", {"command": f"touch {sentinel}"}),
            ("subprocess:run", {"args": ["touch", str(sentinel)]}),
            ("builtins:exec", {"source": f"open({str(sentinel)!r}, 'w')"}),
        ]
        if rng.random() < 0.5:
            spec, kwargs = rng.choice(code)
            return [("set", ("model", "spec"), spec), ("set", ("model", "kwargs"), kwargs)]
        return [
            (
                "set",
                ("model", "spec"),
                rng.choice(
                    [
                        "timm:resnet18",
                        "timm:no_such_model",
                        "torchvision:resnet18",
                        "torchvision:no_such",
                        "timm:",
                        ":x",
                        "x",
                        "",
                        5,
                        None,
                        "nwsconvert.zoo.pretrained:nope",
                        "timm:test_vit",
                    ]
                ),
            )
        ]
    if group == "kwargs":
        return [
            (
                "set",
                ("model", "kwargs"),
                rng.choice(
                    [
                        {"in_chans": 3},
                        {"in_chans": 1, "num_classes": 10**7},
                        {"in_chans": 1, "num_classes": 10**12},
                        {"in_chans": 10**6},
                        {"in_chans": 1, "pretrained": True},
                        {"in_chans": 1, "checkpoint_path": "/etc/passwd"},
                        {"in_chans": 1, "drop_rate": "x"},
                        {"in_chans": 1, "bogus": 1},
                        {"in_chans": 1, "act_layer": "gelu"},
                        {"in_chans": 1, "global_pool": "max"},
                        [],
                        None,
                        {},
                        {"in_chans": -1},
                        {"in_chans": "1"},
                    ]
                ),
            )
        ]
    if group == "convert":
        key, values = rng.choice(
            [
                ("group_size", [2, 0, -1, 10**9, "1", None, 1.0]),
                ("skip", [["*"], ["layer1*"], "*", 5, None, ["fc"]]),
                ("layer_pool_size", [{"*": 7}, {"*": "x"}, {"*": 10**12}, [], None]),
                ("layer_group_size", [{"*": 2}, {"*": 0}, {"*": "x"}]),
                ("init", ["/etc/passwd", "random", "kmeans"]),
                ("seed", ["x", 2**70]),
                ("kmeans_iters", [-1, 10**9]),
                ("bogus", [1]),
                ("pool_size", [7, -1, "32", None]),
            ]
        )
        if rng.random() < 0.15:
            return [("set", ("model", "convert"), rng.choice([None, [], "x", {}]))]
        return [("set", ("model", "convert", key), rng.choice(values))]
    if group == "file" and tasks:
        abs_other = str(other.src / "tasks" / f"task_{t}.nwspack")
        abs_same = str(subj.src / "tasks" / f"task_{t}.nwspack")
        return [
            (
                "set",
                ("tasks", t, "file"),
                rng.choice(
                    [
                        abs_other,
                        abs_same,
                        f"../../../runs/{other.name}/tasks/task_{t}.nwspack",
                        "../x",
                        f"tasks/task_{o}.nwspack",
                        f"tasks/../tasks/task_{o}.nwspack",
                        f"tasks//task_{t}.nwspack",
                        f"tasks/./task_{t}.nwspack",
                        "/etc/passwd",
                        "../../../../../../etc/passwd",
                        "",
                        "manifest.json",
                        "pools.safetensors",
                        "base.nwspack",
                        "tasks",
                        "C:\\x",
                        f"tasks\\task_{t}.nwspack",
                        f"tasks/task_{t}.nwspack\u0000",
                        "/dev/zero",
                        None,
                        5,
                        ["tasks"],
                    ]
                ),
            )
        ]
    if group == "task" and tasks:
        field, values = rng.choice(
            [
                ("id", [o, -1, 10**12, "0", None, 2**62, 0.0, True]),
                ("sha256", [tasks[o].get("sha256"), other.manifest["tasks"][t]["sha256"], "0" * 64, "", None]),
                ("num_classes", [10**9, 0, 3, None, "2"]),
                ("name", [5, None, "x" * 10000]),
                ("class_names", [[], ["a"], 5, [1, 2]]),
                ("metrics", [None, [], {}, {"val_acc": "x"}, {"val_acc": None}]),
                ("bytes", [None, [], {"file": -1}]),
            ]
        )
        if rng.random() < 0.1 and field in tasks[t]:
            return [("del", ("tasks", t, field))]
        return [("set", ("tasks", t, field), rng.choice(values))]
    if group == "pools":
        field, values = rng.choice(
            [
                ("sha256", [other.manifest["pools"]["sha256"], "0" * 64, None]),
                ("file", ["../x", "base.nwspack", "/etc/passwd"]),
                ("bytes", [-1, 10**12, None, "x"]),
            ]
        )
        if rng.random() < 0.15:
            return (
                [("del", ("pools",))] if rng.random() < 0.5 else [("set", ("pools",), rng.choice([None, {}, [], "x"]))]
            )
        return [("set", ("pools", field), rng.choice(values))]
    if group == "base":
        field, values = rng.choice(
            [
                ("sha256", [other.manifest["base"]["sha256"], "0" * 64]),
                ("file", ["../x", "task_0.nwspack", "/etc/passwd"]),
            ]
        )
        return [("set", ("base", field), rng.choice(values))]
    field, values = rng.choice(
        [
            ("run_id", [other.manifest.get("run_id"), None, "", 5]),
            ("format", ["nwsconvert.bundle", "x", None]),
            ("version", [2, 0, "1", None, 1.0, True]),
            ("tasks", [[], {}, None, [*tasks, *tasks[:1]], tasks[:1]]),
            ("data", [None, [], {"input_size": [10**9, 10**9]}]),
            ("model", [None, [], "timm:test_resnet", {}]),
        ]
    )
    if rng.random() < 0.1 and field in m:
        return [("del", (field,))]
    return [("set", (field,), rng.choice(values))]


def targeted_bundle(rng: random.Random, b: dict, case: Case, subj: Subject, other: Subject) -> list:
    rows = b.get("tasks") or {}
    keys = list(rows) if isinstance(rows, dict) else []
    k = rng.choice(keys) if keys else "0"
    o = "1" if k == "0" else "0"
    group = rng.choice(["file", "file", "hash", "row", "key", "top", "data"])
    if group == "file" and keys:
        field = rng.choice(["onnx", "pack", "base"])
        return [
            (
                "set",
                ("tasks", k, field),
                rng.choice(
                    [
                        "../x",
                        "/etc/passwd",
                        f"task_{o}.onnx",
                        f"task_{k}.nwspack",
                        "pools.safetensors",
                        "bundle.json",
                        "",
                        ".",
                        "..",
                        "nonexistent.onnx",
                        f"../../runs/{other.name}/export/task_{k}.onnx",
                        None,
                        5,
                    ]
                ),
            )
        ]
    if group == "hash" and keys:
        field = rng.choice(["onnx_sha256", "pack_sha256", "base_sha256"])
        alt = rows.get(o, {}).get(field) if isinstance(rows.get(o), dict) else None
        if rng.random() < 0.2:
            return [("del", ("tasks", k, field))]
        return [("set", ("tasks", k, field), rng.choice([alt, "0" * 64, "", None, other.bundle["tasks"][k][field]]))]
    if group == "row" and keys:
        field, values = rng.choice(
            [
                ("num_classes", [3, 10**9, 0, None, 1]),
                ("class_names", [["a"], [], None, [1, 2]]),
                ("name", [None, 5]),
                ("onnx_bytes", [-1, None, "x"]),
            ]
        )
        return [("set", ("tasks", k, field), rng.choice(values))]
    if group == "key" and keys:
        return [("rename", ("tasks", k), rng.choice(["00", " 0", "-0", "\u0660", "0x", o, "+0", "1_0", "\u00b2"]))]
    if group == "data":
        field, values = rng.choice(
            [
                ("channels", [0, 3, 10**6, None]),
                ("input_size", [[10**9, 10**9], [], None, [28]]),
                ("mean", [None, [], "x"]),
                ("std", [[0.0], None]),
            ]
        )
        return [("set", ("data", field), rng.choice(values))]
    field, values = rng.choice(
        [
            ("pool_sha256", [other.bundle["pool_sha256"], "0" * 64, str(b.get("pool_sha256")).upper(), None]),
            ("version", [1, 3, 0, "2", True, None]),
            ("format", ["nwsconvert.run", None, "x"]),
            ("tasks", [{}, [], None]),
            ("model", [{"spec": "subprocess:getoutput"}, None]),
            ("pool_bytes", [-1, None]),
        ]
    )
    return [("set", (field,), rng.choice(values))]


def swap_rows_ops(rng: random.Random, doc: dict, target: str) -> list:
    if target.endswith("manifest.json"):
        tasks = doc.get("tasks") or []
        if len(tasks) < 2:
            return []
        fields = rng.choice(
            [None, ("file",), ("sha256",), ("file", "sha256"), ("file", "sha256", "name", "num_classes", "class_names")]
        )
        fields = fields or tuple(k for k in tasks[0] if k != "id")
        ops = []
        for f in fields:
            ops += [("set", ("tasks", 0, f), tasks[1].get(f)), ("set", ("tasks", 1, f), tasks[0].get(f))]
        return ops
    rows = doc.get("tasks") or {}
    if not {"0", "1"} <= set(rows):
        return []
    fields = rng.choice([None, ("onnx", "onnx_sha256"), ("pack", "pack_sha256"), ("onnx",), ("name", "class_names")])
    if fields is None:
        return [("set", ("tasks", "0"), rows["1"]), ("set", ("tasks", "1"), rows["0"])]
    ops = []
    for f in fields:
        ops += [("set", ("tasks", "0", f), rows["1"].get(f)), ("set", ("tasks", "1", f), rows["0"].get(f))]
    return ops


def json_ops(rng: random.Random, doc, kind: str, rehash: bool) -> list:
    """Generic delete / rename / set at a random path."""
    paths = [p for p in json_paths(doc) if not (rehash and "header_sha256" in p)]
    if kind == "json_rename":
        paths = [p for p in paths if isinstance(p[-1], str)]
    if not paths:
        return []
    path = rng.choice(paths)
    if kind == "json_delete":
        return [("del", path)]
    if kind == "json_rename":
        return [("rename", path, rename_key(rng, path[-1], get_at(doc, path[:-1])))]
    return [("set", path, random_value(rng, get_at(doc, path)))]


def describe_ops(ops) -> list:
    out = []
    for op in ops:
        if op[0] == "set":
            v = json.dumps(op[2], default=repr)
            out.append(f"{show_path(op[1])} = {v if len(v) <= 120 else v[:117] + '...'}")
        elif op[0] == "del":
            out.append(f"del {show_path(op[1])}")
        else:
            out.append(f"rename {show_path(op[1])} -> {op[2]!r}")
    return out


def mutate(case: Case, rng: random.Random, root: Path, subj: Subject, other: Subject, sentinel: Path) -> dict:
    """Apply the case's mutation to ``root/<target>``; returns its description."""
    path = root / case.target
    data = subj.files[case.target]
    kind = case.kind
    base_kind, _, variant = kind.partition("+")
    is_st = case.target.endswith((".safetensors", ".nwspack"))
    desc: dict = {}
    new: bytes | None = None
    if kind.startswith("flip_"):
        lo, hi = 0, len(data)
        if is_st:
            hlen = struct.unpack("<Q", data[:8])[0]
            if base_kind == "flip_st_header":
                hi = 8 + hlen
            elif base_kind == "flip_json_header":
                lo, hi = json_string_span(data) or (0, 8 + hlen)
            elif base_kind == "flip_data":
                lo = 8 + hlen
        new, flips = flip_bits(rng, data, lo, hi)
        desc["flips"] = flips
        if variant == "rehash":
            new = resign(new, content=True)
    elif kind == "truncate":
        size = len(data)
        choices = [rng.randrange(size), rng.randrange(min(size, 17)), max(0, size - rng.randint(1, 16))]
        if is_st:
            hlen = struct.unpack("<Q", data[:8])[0]
            choices.append(min(size - 1, max(0, 8 + hlen + rng.randint(-16, 16))))
        n = rng.choice(choices)
        new, desc["length"] = data[:n], n
    elif kind == "append":
        n = rng.choice([1, 7, 8, rng.randint(1, 4096)])
        extra = rng.choice([lambda: rng.randbytes(n), lambda: b"\0" * n, lambda: data[-n:]])()
        new, desc["appended"] = data + extra, len(extra)
    elif kind == "empty":
        new = b""
    elif kind == "random_bytes":
        n = rng.choice([len(data), rng.randint(1, 2 * len(data)), rng.randint(1, 64)])
        new, desc["length"] = rng.randbytes(n), n
    elif kind == "header_len":
        value = rng.choice(
            [
                0,
                1,
                7,
                len(data) - 8,
                len(data),
                2**31,
                2**63,
                2**64 - 1,
                100 * 1024 * 1024 + 1,
                struct.unpack("<Q", data[:8])[0] + rng.choice([-8, -1, 1, 8]),
            ]
        )
        value = max(0, min(value, 2**64 - 1))
        new, desc["header_len"] = struct.pack("<Q", value) + data[8:], value
    elif kind == "st_repad":  # the same header and tensors, laid out again: the tensors move in the file
        hlen, header, body = st_split(data)
        if rng.random() < 0.5:
            pad = 8 * rng.randint(1, 4)
            new = struct.pack("<Q", hlen + pad) + data[8 : 8 + hlen] + b" " * pad + body
            desc["layout"] = f"header padded with {pad} more spaces"
        else:
            meta = header.pop("__metadata__")
            header = {"__metadata__": meta, **dict(sorted(header.items(), reverse=True))}
            new = st_join(header, body)
            desc["layout"] = "header written again, tensor entries in reverse order (+ padding to 8 bytes)"
    elif base_kind == "st_json_edit":
        hlen, header, body = st_split(data)
        names = [k for k in header if k != "__metadata__"]
        name = rng.choice(names)
        t = header[name]
        what = rng.randrange(9)
        if what == 0:
            t["dtype"] = rng.choice(["F32", "I32", "U8", "F16", "I64", "BOOL", "F64", "X", None])
            desc["edit"] = f"{name}.dtype = {t['dtype']}"
        elif what == 1:
            t["shape"] = rng.choice(
                [[], [0], [*t["shape"], 1], t["shape"][::-1], [2**62], [-1], [x * 2 for x in t["shape"]], "x", None]
            )
            desc["edit"] = f"{name}.shape = {t['shape']}"
        elif what == 2:
            s, e = t["data_offsets"]
            d = rng.choice([-8, -4, -1, 1, 4, 8])
            t["data_offsets"] = rng.choice([[s + d, e + d], [s, e + d], [e, s], [s, 2**63], [-1, e], [s], None])
            desc["edit"] = f"{name}.data_offsets = {t['data_offsets']}"
        elif what == 3:
            del header[name]
            desc["edit"] = f"del {name}"
        elif what == 4:
            header[name + rng.choice(["x", "/", ""]) + "_"] = header.pop(name)
            desc["edit"] = f"rename {name}"
        elif what == 5:
            other_name = rng.choice(names)
            header[name]["data_offsets"] = list(header[other_name]["data_offsets"])
            desc["edit"] = f"{name}.data_offsets = those of {other_name}"
        elif what == 6:
            header["extra/x"] = {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
            desc["edit"] = "add empty tensor extra/x"
        elif what == 7:
            header["__metadata__"] = rng.choice(
                [None, {}, {"nwsconvert": 5}, {"nwsconvert": "{}"}, "x", {**header["__metadata__"], "x": "y"}]
            )
            desc["edit"] = f"__metadata__ = {str(header['__metadata__'])[:60]}"
        else:
            header = rng.choice([[], "x", {"__metadata__": header["__metadata__"]}])
            desc["edit"] = f"header = {str(header)[:60]}"
        new = (
            st_join(header, body)
            if isinstance(header, dict)
            else struct.pack("<Q", 16) + json.dumps(header).encode().ljust(16) + body
        )
        if variant == "rehash" and isinstance(header, dict) and isinstance(header.get("__metadata__"), dict):
            try:
                new = resign(new, content=True)
            except (KeyError, TypeError, ValueError, AttributeError):
                desc["rehash"] = "not possible"
    elif base_kind.startswith("json_"):
        text_json = not is_st
        if text_json:
            doc = json.loads(data)
        else:
            _, header, body = st_split(data)
            doc = json.loads(header["__metadata__"]["nwsconvert"])
        if variant == "downgrade":
            doc["version"] = rng.choice([1, 2]) if "taskpack" in str(doc.get("format")) else 1
            doc.pop("header_sha256", None)
        rehash = variant in ("rehash", "downgrade")
        if base_kind == "json_targeted":
            if case.target.endswith("manifest.json"):
                ops = targeted_manifest(rng, doc, case, subj, other, sentinel)
            elif case.target.endswith("bundle.json"):
                ops = targeted_bundle(rng, doc, case, subj, other)
            elif case.target.endswith(".nwspack"):
                ops = targeted_pack(rng, doc, case, subj, other, rehash)
            else:
                ops = targeted_pool(rng, doc, other, rehash)
        elif base_kind == "json_swap_rows":
            ops = swap_rows_ops(rng, doc, case.target)
        else:
            ops = json_ops(rng, doc, base_kind, rehash)
        apply_ops(doc, ops)
        desc["ops"] = describe_ops(ops)
        if text_json:
            new = (json.dumps(doc, indent=2) + "\n").encode()
        else:
            if variant == "rehash" and isinstance(doc, dict):
                doc["header_sha256"] = header_digest(doc)
            header["__metadata__"]["nwsconvert"] = json.dumps(doc, sort_keys=True)
            new = st_join(header, body)
    elif kind == "swap:other_run":
        new = other.files[case.target]
    elif kind == "swap:other_task":
        rel = re.sub(r"task_(\d)", lambda m: f"task_{1 - int(m.group(1))}", case.target)
        new, desc["from"] = subj.files[rel], rel
    elif kind == "swap:base":
        rel = case.target.rsplit("/", 1)[0].replace("/tasks", "") + "/base.nwspack"
        new, desc["from"] = subj.files[rel], rel
    elif kind == "swap:task":
        rel = case.target.replace(
            "base.nwspack",
            f"tasks/task_{case.task}.nwspack" if case.target.startswith("run/") else f"task_{case.task}.nwspack",
        )
        new, desc["from"] = subj.files[rel], rel
    elif kind == "swap:pack":
        rel = rng.choice(["run/base.nwspack", "run/tasks/task_0.nwspack"])
        new, desc["from"] = subj.files[rel], rel
    elif kind.startswith("symlink:"):
        dest = {
            "symlink:other_run": lambda: other.src_path(case.target),
            "symlink:same_outside": lambda: subj.src_path(case.target),
            "symlink:dev_zero": lambda: Path("/dev/zero"),
            "symlink:dangling": lambda: root / "no_such_file",
        }[kind]()
        path.unlink()
        path.symlink_to(dest)
        desc["link_to"] = str(dest)
        return desc
    elif kind == "remove":
        path.unlink()
        return desc
    else:
        raise AssertionError(kind)
    path.write_bytes(new)
    desc["bytes"] = len(new)
    return desc


# ---------------------------------------------------------------------- readers


def canon(x) -> str:
    return json.dumps(x, sort_keys=True, default=repr)


def dict_diff(a, b, path=()) -> str | None:
    """The first path where two JSON-like values differ (None: equal)."""
    if type(a) is not type(b):
        return show_path(path) or "<root>"
    if isinstance(a, dict):
        for k in list(dict.fromkeys([*a, *b])):
            if k not in a or k not in b:
                return show_path((*path, k))
            d = dict_diff(a[k], b[k], (*path, k))
            if d:
                return d
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return show_path(path) or "<root>"
        for j, (x, y) in enumerate(zip(a, b)):
            d = dict_diff(x, y, (*path, j))
            if d:
                return d
        return None
    return None if canon(a) == canon(b) else (show_path(path) or "<root>")


def tensor_key(t) -> tuple:
    import torch

    t = t.detach().cpu().contiguous()
    return (str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def tensors_diff(a: dict, b: dict, what: str) -> str | None:
    if list(sorted(a)) != list(sorted(b)):
        return f"{what}: keys {sorted(set(a) ^ set(b))[:3]}"
    bad = [k for k in a if tensor_key(a[k]) != tensor_key(b[k])]
    return f"{what}: {len(bad)} differ, e.g. {bad[0]}" if bad else None


def pack_diff(a, b) -> str | None:
    for f in ("layers", "pool_sha256", "num_classes", "model_spec", "meta", "sha256", "base_sha256", "run_id", "task"):
        if canon(getattr(a, f)) != canon(getattr(b, f)):
            return f"header field {f}" + (f" ({dict_diff(getattr(a, f), getattr(b, f))})" if f == "layers" else "")
    return tensors_diff(a.indices, b.indices, "indices") or tensors_diff(a.state, b.state, "state")


class Readers:
    """Every reader, as ``name(case) -> result``; ``diff(name, case, result, ref) -> str | None``."""

    def __init__(self, root: Path, x):
        import numpy as np
        import torch

        import nwsconvert
        from nwsconvert.analysis.selection import analyse_run
        from nwsconvert.analysis.summary import run_summary
        from nwsconvert.export import Runtime, export_bundle
        from nwsconvert.export.bundlefile import read_bundle

        self.np, self.torch, self.nws = np, torch, nwsconvert
        self.analyse_run, self.Runtime, self.export_bundle, self.read_bundle, self.run_summary = (
            analyse_run,
            Runtime,
            export_bundle,
            read_bundle,
            run_summary,
        )
        self.root, self.x = root, x
        self.xt = torch.from_numpy(x)

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def bundle(self) -> Path:
        return self.root / "bundle"

    def expectations(self, subj: Subject, rel: str) -> dict:
        name = rel.rsplit("/", 1)[-1]
        m, b = subj.manifest, subj.bundle
        if name == "base.nwspack":
            return {"sha256": m["base"]["sha256"], "pool_sha256": m["pools"]["sha256"], "run_id": m.get("run_id")}
        t = int(name[5])
        if rel.startswith("run/"):
            return {
                "sha256": m["tasks"][t]["sha256"],
                "pool_sha256": m["pools"]["sha256"],
                "run_id": m.get("run_id"),
                "task": t,
            }
        return {"sha256": b["tasks"][str(t)]["pack_sha256"], "pool_sha256": b["pool_sha256"], "task": t}

    def pack_rel(self, case: Case) -> str:
        """The pack file a pack reader opens (for pack_dep: a task pack beside the mutated base)."""
        if case.reader != "pack_dep":
            return case.target
        return (
            f"run/tasks/task_{case.task}.nwspack"
            if case.target.startswith("run/")
            else f"bundle/task_{case.task}.nwspack"
        )

    def ref_key(self, case: Case) -> tuple:
        if case.reader in ("pack", "pack_expect", "pack_dep"):
            return ("pack", self.pack_rel(case))
        if case.reader == "pool":
            return ("pool",)
        if case.reader in ("load", "runtime", "switch"):
            return (case.reader, case.task)
        return (case.reader,)

    def call(self, case: Case, subj: Subject):
        r = case.reader
        if r in ("pack", "pack_expect", "pack_dep"):
            rel = self.pack_rel(case)
            kwargs = self.expectations(subj, rel) if r != "pack" else {}
            return self.nws.TaskPack.load(self.root / rel, **kwargs)
        if r == "pool":
            return self.nws.PoolSet.load(self.root / case.target)
        if r == "manifest":
            m = self.nws.RunDir(self.run).read()
            return m.to_dict() if hasattr(m, "to_dict") else m  # a Manifest since 250a190, a dict before
        if r == "load":
            model = self.nws.load(self.run, case.task)
            with self.torch.no_grad():
                logits = model(self.xt)
            return {k: v.clone() for k, v in model.state_dict().items()}, logits
        if r == "summary":
            return self.run_summary(self.run)
        if r == "analyse":
            return self.analyse_run(self.run)
        if r == "export":
            return self.export_bundle(self.run, self.root / "out", tasks="all", onnx=False)
        if r == "bundle":
            return self.read_bundle(self.bundle)
        if r == "runtime":
            return self.Runtime(self.bundle, device="cpu", threads=1).run(case.task, self.x)
        if r == "switch":  # the one-session mode: the template, the recipe in bundle.json, the task's pack
            return self.Runtime(self.bundle, device="cpu", threads=1, mode="switch").run(case.task, self.x)
        raise AssertionError(r)

    def diff(self, case: Case, result, ref) -> str | None:
        r = case.reader
        if r in ("pack", "pack_expect", "pack_dep"):
            return pack_diff(result, ref)
        if r == "pool":
            return tensors_diff(result.pools, ref.pools, "pools")
        if r == "load":
            d = tensors_diff(result[0], ref[0], "state_dict")
            if d:
                return d
            if tensor_key(result[1]) != tensor_key(ref[1]):
                return f"logits differ (max abs {float((result[1] - ref[1]).abs().max()) if result[1].shape == ref[1].shape else 'shape'})"
            return None
        if r in ("runtime", "switch"):
            a, b = self.np.asarray(result), self.np.asarray(ref)
            if a.shape != b.shape or a.dtype != b.dtype or a.tobytes() != b.tobytes():
                return f"logits differ ({f'max abs {float(self.np.abs(a - b).max()):.3g}' if a.shape == b.shape else f'shape {a.shape}'})"
            return None
        d = dict_diff(result, ref)
        return None if d is None else f"result differs at {d}"


# ------------------------------------------------------------------- safety audit


class Audit:
    """Records writes outside the scratch folder and process spawns while a reader runs."""

    active = False
    scratch = ""
    events: list = []
    reads: list = []
    system: tuple = ()
    WRITE_EVENTS = {
        "os.rename": (0, 1),
        "os.remove": (0,),
        "os.rmdir": (0,),
        "os.mkdir": (0,),
        "os.truncate": (0,),
        "os.chmod": (0,),
        "os.chown": (0,),
        "os.link": (1,),
        "os.symlink": (1,),
        "os.utime": (0,),
        "shutil.rmtree": (0,),
        "shutil.copyfile": (1,),
        "shutil.move": (1,),
        "shutil.copytree": (1,),
    }
    EXEC_EVENTS = (
        "subprocess.Popen",
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "pty.spawn",
        "os.startfile",
    )

    @classmethod
    def inside(cls, p: str) -> bool:
        return p == cls.scratch or p.startswith(cls.scratch + os.sep)

    @classmethod
    def hook(cls, event: str, args) -> None:
        if not cls.active:
            return
        try:
            if event == "open":
                path, mode, flags = args
                if not isinstance(path, (str, bytes, os.PathLike)):
                    return
                p = os.path.abspath(os.fsdecode(path))
                writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                    isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
                )
                if writing and not cls.inside(p):
                    cls.events.append(f"write {p}")
                elif not writing and not cls.inside(p) and not p.startswith(cls.system):
                    cls.reads.append(p)
            elif event in cls.WRITE_EVENTS:
                for j in cls.WRITE_EVENTS[event]:
                    a = args[j] if j < len(args) else None
                    if isinstance(a, (str, bytes, os.PathLike)):
                        p = os.path.abspath(os.fsdecode(a))
                        if not cls.inside(p):
                            cls.events.append(f"{event} {p}")
            elif event.startswith(cls.EXEC_EVENTS):
                cls.events.append(f"{event} {repr(args)[:200]}")
        except Exception:  # an audit hook must never break the call it watches
            pass


class CaseTimeout(BaseException):
    pass


def _on_alarm(signum, frame):
    raise CaseTimeout()


# ----------------------------------------------------------------------- worker


def lib_roots() -> list[tuple[str, str]]:
    """Where the imported nwsconvert, nwsconvert.export and nwsconvert.zoo live (export and zoo first: they may sit inside)."""
    import nwsconvert
    import nwsconvert.export
    import nwsconvert.zoo

    return [
        (os.path.dirname(m.__file__) + os.sep, label)
        for m, label in ((nwsconvert.export, "export/"), (nwsconvert.zoo, "zoo/"), (nwsconvert, "nwsconvert/"))
    ]


def lib_frames(tb) -> tuple[str | None, str | None]:
    """(innermost frame in nwsconvert's code, innermost frame overall) as ``file:line (function)``;
    library files are named as in the repository (``nwsconvert/train/specs.py``, ``export/runtime.py``)."""
    site = raised = None
    for fs in traceback.extract_tb(tb):
        name = next(
            (label + fs.filename[len(root) :] for root, label in LIB_ROOTS if fs.filename.startswith(root)), None
        )
        if name is not None:
            site = f"{name}:{fs.lineno} ({fs.name})"
        shown = name or (os.path.relpath(fs.filename, REPO) if fs.filename.startswith(str(REPO)) else fs.filename)
        raised = f"{shown}:{fs.lineno} ({fs.name})"
    return site, raised


KNOWN_FILES = (
    "manifest.json",
    "pools.safetensors",
    "base.nwspack",
    "task_0.nwspack",
    "task_1.nwspack",
    "bundle.json",
    "task_0.onnx",
    "task_1.onnx",
)


def expected_difference(case: Case, diff: str) -> str | None:
    """Why a silently different result is by design, if it is (the rest are findings)."""
    if case.target.endswith("manifest.json") and case.reader in ("manifest", "summary", "analyse", "export"):
        return "unsigned manifest.json read back as edited"
    if case.target.endswith("bundle.json") and case.reader == "bundle":
        return "unsigned bundle.json read back as edited"
    resigned = case.kind.endswith(("+rehash", "+downgrade"))
    if resigned and case.reader in ("pack", "pool"):
        return "re-signed file read without expectations"
    if case.kind.startswith(("swap:", "symlink:")) and case.reader == "pool":
        return "another valid pool file read without expectations"
    if case.reader in ("summary", "export") and re.search(r"(file_bytes|pack_bytes|base_bytes|pool_bytes)$", diff):
        return "a valid file laid out again or re-signed: only the file size it reports differs"
    if (
        resigned
        and case.reader not in ("load", "runtime", "switch")
        and diff.startswith("header field")
        and "indices" not in diff
    ):
        return "re-signed header: the expected sha256 pins the tensors, not informative header fields"
    return None


class Worker:
    def __init__(self, args, runs: dict[str, Path]):
        import numpy as np
        import torch

        torch.set_num_threads(1)
        warnings.simplefilter("ignore")
        import onnxruntime

        onnxruntime.set_default_logger_severity(4)  # graphs refused on purpose would log C++ errors on every case
        import nwsconvert.formats.packs

        global LIB_ROOTS
        LIB_ROOTS = lib_roots()
        self.args = args
        self.work = Path(args.work).resolve()
        self.scratch = self.work / "scratch"
        self.roots = {name: self.scratch / name for name in runs}
        self.stats: dict = {}
        self.sentinel = self.work / SENTINEL_NAME
        packs = nwsconvert.formats.packs
        # Library revisions before clear_base_caches (a --lib-rev run) kept one cache, cleared by name.
        self.clear_cache = getattr(packs, "clear_base_caches", None) or packs._load_base.cache_clear
        self.subjects = {name: Subject(name, run) for name, run in runs.items()}
        x = np.random.default_rng(0).standard_normal((4, 1, 28, 28)).astype(np.float32)
        self.readers = Readers(self.scratch, x)
        self.compute_refs()
        Audit.scratch = str(self.scratch)
        Audit.system = tuple(
            {
                sys.prefix,
                sys.base_prefix,
                sys.exec_prefix,
                "/usr",
                "/proc",
                "/sys",
                "/dev",
                "/lib",
                "/etc/ld.so",
                str(REPO),
            }
        )
        sys.addaudithook(Audit.hook)
        signal.signal(signal.SIGALRM, _on_alarm)

    def prepare(self, subj: Subject) -> None:
        """A fresh copy of the subject's run and bundle under ``scratch/<subject>``."""
        root = self.roots[subj.name]
        if root.exists() or root.is_symlink():
            shutil.rmtree(root)
        for rel, data in subj.files.items():
            p = root / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
            self.stats[(subj.name, rel)] = _stat(p)

    def restore(self, subj: Subject, target: str | None) -> list[str]:
        """Put the subject's copy back as it was; returns what changed besides ``target`` (and ``out/``)."""
        root = self.roots[subj.name]
        changed = []
        for rel, data in subj.files.items():
            p = root / rel
            if rel == target or _stat(p) != self.stats[(subj.name, rel)]:
                if rel != target:
                    changed.append(rel)
                if p.is_symlink() or p.exists():
                    p.unlink()
                p.write_bytes(data)
                self.stats[(subj.name, rel)] = _stat(p)
        dirs = {"run", "run/tasks", "bundle"}
        for dirpath, dirnames, filenames in os.walk(root):
            here = os.path.relpath(dirpath, root)
            for d in list(dirnames):
                rel = os.path.normpath(os.path.join(here, d))
                if rel not in dirs:
                    shutil.rmtree(os.path.join(dirpath, d))
                    dirnames.remove(d)
                    changed.append(rel + "/")
            for f in filenames:
                rel = os.path.normpath(os.path.join(here, f))
                if rel not in subj.files:
                    os.unlink(os.path.join(dirpath, f))
                    changed.append(rel)
        return changed

    def compute_refs(self) -> None:
        """Every reader on an unmutated copy, at the same path the cases use."""
        for subj in self.subjects.values():
            self.prepare(subj)
            self.readers.root = self.roots[subj.name]
            for target, (_, _, readers) in TARGETS.items():
                for reader in readers:
                    for task in TASKS:
                        case = Case(-1, subj.name, target, "none", reader, task)
                        key = self.readers.ref_key(case)
                        if key in subj.refs:
                            continue
                        self.clear_cache()
                        subj.refs[key] = self.readers.call(case, subj)
                        again = self.readers.call(
                            case, subj
                        )  # readers must be deterministic for "identical" to mean anything
                        if self.readers.diff(case, again, subj.refs[key]):
                            raise SystemExit(f"reader {reader} is not deterministic on run {subj.name}: cannot fuzz")
                        if self.restore(subj, None) not in ([], ["out/"]):
                            raise SystemExit(f"reader {reader} changed the unmutated copy of run {subj.name}")

    def run_case(self, i: int, verbose: bool = False) -> dict:
        case, rng = plan_case(self.args.seed, i, self.args.heavy)
        subj = self.subjects[case.subject]
        other = self.subjects[next(n for n in self.subjects if n != case.subject)]
        root = self.readers.root = self.roots[subj.name]
        try:
            case.mutation = mutate(case, rng, root, subj, other, self.sentinel)
        except Exception as e:  # noqa: BLE001 - a bug of this benchmark, not of nwsconvert: recorded apart
            self.restore(subj, case.target)
            return {
                "i": i,
                "subject": case.subject,
                "target": case.target,
                "kind": case.kind,
                "reader": case.reader,
                "task": case.task,
                "mutation": {},
                "outcome": "harness_error",
                "message": f"{type(e).__name__}: {e}",
                "seconds": 0.0,
                "rss_growth_gib": 0.0,
            }
        self.clear_cache()  # bases are cached per (path, mtime, size): each case decodes its own
        rec = {
            "i": i,
            "subject": case.subject,
            "target": case.target,
            "kind": case.kind,
            "reader": case.reader,
            "task": case.task,
            "mutation": case.mutation,
        }
        if verbose:
            print(json.dumps(rec, indent=2, default=repr))
        Audit.events, Audit.reads = [], []
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result = exc = None
        tic = time.perf_counter()
        Audit.active = True
        signal.alarm(self.args.alarm)
        try:
            result = self.readers.call(case, subj)
        except BaseException as e:  # noqa: BLE001 - classifying every outcome is the point
            if isinstance(e, KeyboardInterrupt):
                raise
            exc = e
        finally:
            signal.alarm(0)
            Audit.active = False
        seconds = time.perf_counter() - tic
        rss_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 2**20
        rec.update(seconds=round(seconds, 4), rss_growth_gib=round(rss_gib, 3))
        from nwsconvert.errors import NWSError

        if exc is not None:
            msg = str(exc)
            site, raised = lib_frames(exc.__traceback__)
            rec.update(
                exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
                message=msg[:400],
                site=site,
                raised_at=raised,
                named=[f for f in KNOWN_FILES if f in msg],
            )
            alloc = isinstance(exc, MemoryError) or "can't allocate memory" in msg or "Unable to allocate" in msg
            if isinstance(exc, CaseTimeout):
                rec["outcome"], rec["resource"] = "resource", f"alarm after {self.args.alarm} s"
            elif alloc:
                rec["outcome"], rec["resource"] = "resource", "allocation failed"
            elif isinstance(exc, (NWSError, FileNotFoundError)):
                rec["outcome"] = "clear_error" if case.basename in msg else "error_unnamed"
            else:
                rec["outcome"] = "raw_exception"
            if verbose:
                traceback.print_exception(exc)
        else:
            d = self.readers.diff(case, result, subj.refs[self.readers.ref_key(case)])
            rec["outcome"] = "identical" if d is None else "silently_different"
            if d is not None:
                rec["difference"] = d
                why = expected_difference(case, d)
                if why:
                    rec["expected"] = why
        if seconds > self.args.slow or rss_gib > self.args.rss_gib:
            rec["resource"] = f"{seconds:.1f} s, peak RSS +{rss_gib:.2f} GiB"
            rec["was"] = rec["outcome"]
            rec["outcome"] = "resource"
        if verbose:
            print(f"mutated copy: {root} (restored by the next case)")
        else:
            side = [c for c in self.restore(subj, case.target) if not (case.reader == "export" and c.startswith("out"))]
            if side:
                rec["inputs_changed"] = side
        if Audit.events:
            rec["audit"] = Audit.events[:10]
        if Audit.reads:
            rec["reads_outside"] = sorted(set(Audit.reads))[:10]
        if self.sentinel.exists():
            rec["sentinel"] = True
        return rec


def _stat(p: Path):
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return None
    return (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino)


def worker_main(args) -> None:
    work = Path(args.work).resolve()
    runs = {name: work / "runs" / name for name in RUN_SEEDS}
    os.chdir(work / "cwd")
    from tqdm import tqdm

    w = Worker(args, runs)
    if args.mem_limit_gib:  # an allocation far past the headroom fails (MemoryError) instead of taking the machine
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize")) * 1024
        limit = vm + int(args.mem_limit_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    state = work / "state.json"
    out = open(work / "cases.jsonl", "a", buffering=1)
    stop = args.start + args.count
    done = set(read_cases(work / "cases.jsonl"))  # after a restart, only the cases not yet recorded
    bar = tqdm(
        total=args.cases,
        initial=sum(1 for i in done if i < args.cases),
        mininterval=15,
        desc="fuzz",
        file=sys.stdout,
        dynamic_ncols=False,
        ncols=100,
    )
    for i in range(args.start, stop):
        if i in done:
            continue
        state.write_text(json.dumps({"i": i, "start": time.time()}))
        rec = w.run_case(i)
        out.write(json.dumps(rec, default=repr) + "\n")
        bar.update(1)
        if rec["rss_growth_gib"] > args.rss_gib:
            break  # a fresh worker, so that peak RSS measures the next cases again
    bar.close()
    state.write_text(json.dumps({"i": None}))


# ------------------------------------------------------------------- supervisor


def read_cases(path: Path) -> dict[int, dict]:
    out = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            out[rec["i"]] = rec
    return out


def rss_gib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 2**20
    except (OSError, StopIteration):
        return 0.0


def supervise(args, work: Path) -> float:
    """Run the cases in one worker at a time; a dead or stuck worker's case is recorded and the rest go on."""
    cases_file, state = work / "cases.jsonl", work / "state.json"
    tic = time.time()
    while True:
        done = read_cases(cases_file)
        start = next((i for i in range(args.cases) if i not in done), None)
        if start is None:
            return time.time() - tic
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            "--start",
            str(start),
            "--count",
            str(args.cases - start),
            *args.passthrough,
        ]
        with open(
            work / "worker.log", "a"
        ) as log:  # onnxruntime logs refused graphs on stderr: kept out of the progress output
            proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}, stderr=log)
        killed = None
        while proc.poll() is None:
            time.sleep(1.0)
            try:
                st = json.loads(state.read_text())
            except (OSError, ValueError):
                continue
            if st.get("i") is not None and time.time() - st["start"] > args.hard_timeout:
                killed = f"watchdog: case ran {time.time() - st['start']:.0f} s (stuck in native code?)"
            elif rss_gib(proc.pid) > args.kill_gib:
                killed = f"watchdog: worker RSS above {args.kill_gib} GiB"
            if killed:
                proc.kill()
                proc.wait()
        try:
            st = json.loads(state.read_text())
        except (OSError, ValueError):
            st = {}
        i = st.get("i")
        if i is not None and i not in read_cases(cases_file):
            case, _ = plan_case(args.seed, i, args.heavy)
            rec = {
                "i": i,
                "subject": case.subject,
                "target": case.target,
                "kind": case.kind,
                "reader": case.reader,
                "task": case.task,
                "outcome": "resource" if killed else "crash",
                "seconds": round(time.time() - st["start"], 2),
                "resource" if killed else "crash": killed
                or f"worker exit status {proc.returncode} (see {work / 'worker.log'})",
            }
            with open(cases_file, "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(
                f"\ncase {i}: {rec['outcome']} ({killed or proc.returncode}); restarting the worker",
                file=sys.stderr,
                flush=True,
            )
        elif proc.returncode != 0:
            raise SystemExit(f"worker failed outside a case (exit {proc.returncode}); see the messages above")


# ---------------------------------------------------------------------- report


def template(msg: str) -> str:
    """A message with paths, hashes and numbers blanked, for grouping."""
    msg = re.sub(r"(/[^\s:'\"(),]+)+", "<path>", msg)
    msg = re.sub(r"[0-9a-f]{12,}(\.\.\.)?", "<hex>", msg)
    msg = re.sub(r"\d+", "N", msg)
    return msg[:160]


def group_key(rec: dict) -> str:
    o = rec["outcome"]
    if o == "raw_exception":
        return f"{rec['exc_type']} at {rec.get('site') or rec.get('raised_at')}"
    if o == "error_unnamed":
        return f"{rec['reader']} | {rec['target']} | {rec['exc_type']}: {template(rec['message'])}"
    if o == "silently_different":
        what = rec["mutation"].get("ops") or [rec["kind"]]
        field = re.sub(r"\[\d+\]", "[i]", what[0].split(" = ")[0]) if what else ""
        return f"{rec['reader']} | {rec['target']} | {rec['kind']} | {field} | {rec.get('expected', 'FINDING')}"
    if o == "identical":
        return f"{rec['reader']} | {rec['target']} | {rec['kind']}"
    if o in ("resource", "crash"):
        return f"{rec['reader']} | {rec['target']} | {rec['kind']} | {rec.get('resource') or rec.get('crash')} | {rec.get('exc_type', '')}"
    return ""


def table(rows: list[list[str]], head: list[str]) -> str:
    widths = [max(len(str(r[j])) for r in [head, *rows]) for j in range(len(head))]

    def line(cells):
        return "  ".join(str(c).rjust(w) if j else str(c).ljust(w) for j, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731

    return "\n".join([line(head), "  ".join("-" * w for w in widths), *map(line, rows)])


def count_table(recs, by: str) -> tuple[str, dict]:
    counts: dict[str, Counter] = defaultdict(Counter)
    for r in recs:
        counts[r[by]][r["outcome"]] += 1
    cols = [o for o in OUTCOMES if any(c[o] for c in counts.values())]
    rows = [[k, sum(c.values()), *(c[o] for o in cols)] for k, c in sorted(counts.items())]
    total = Counter(r["outcome"] for r in recs)
    rows.append(["TOTAL", len(recs), *(total[o] for o in cols)])
    return table(rows, [by, "cases", *cols]), {k: dict(c) for k, c in counts.items()}


def environment(lib_commit: str | None, lib_before, lib_after) -> dict:
    def version(mod):
        try:
            return __import__(mod).__version__
        except Exception:  # noqa: BLE001
            return None

    cpu = (
        next(
            (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
            platform.processor(),
        )
        if os.path.exists("/proc/cpuinfo")
        else platform.processor()
    )
    mem = (
        next((int(line.split()[1]) // 2**20 for line in open("/proc/meminfo") if line.startswith("MemTotal")), None)
        if os.path.exists("/proc/meminfo")
        else None
    )
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--", "nwsconvert", "export", "zoo"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    if lib_commit:
        library = {
            "git_commit": lib_commit[:7],
            "library": f"git archive {lib_commit[:12]} (--lib-rev), imported from {lib_before[0]}",
        }
    else:
        library = {
            "git_commit": head,
            "library": f"installed (editable) working tree at {lib_before[0]}",
            "library_modified_since_commit": bool(dirty),
        }
    return {
        **library,
        "repository_head": head,
        "library_sha256_before": lib_before[1],
        "library_sha256_after": lib_after[1],
        "library_changed_during_run": lib_before != lib_after,
        "python": platform.python_version(),
        **{m: version(m) for m in ("torch", "onnxruntime", "numpy", "safetensors", "timm", "onnx")},
        "machine": f"{platform.machine()}, {cpu}, {os.cpu_count()} CPUs, {mem} GiB RAM, {platform.platform()}",
    }


def report(args, work: Path, wall: float, digests_ok: bool, extra: dict, env: dict) -> dict:
    recs = sorted((r for i, r in read_cases(work / "cases.jsonl").items() if i < args.cases), key=lambda r: r["i"])
    totals = Counter(r["outcome"] for r in recs)
    print(
        f"\nnwsconvert reader fuzzing: {len(recs)} cases, seed {args.seed}, library {env['git_commit']} ({env['library']}), "
        f"wall {wall / 60:.1f} min\n"
    )
    if env["library_changed_during_run"]:
        print("WARNING: the library's code changed during the run: the counts mix versions\n")
    print(
        table(
            [[o, totals[o], f"{100 * totals[o] / max(1, len(recs)):.2f}%"] for o in OUTCOMES],
            ["outcome", "cases", "share"],
        )
    )
    tables = {}
    for by in ("kind", "reader", "target"):
        text, tables[by] = count_table(recs, by)
        print(f"\nby {by}\n{text}")
    groups: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in recs:
        if r["outcome"] != "clear_error":
            groups[r["outcome"]][group_key(r)].append(r)
    cmd = f"{sys.executable} {os.path.relpath(__file__, REPO)} --work {work} --seed {args.seed} --heavy {args.heavy} --replay"
    examples = {}
    for o in OUTCOMES[1:]:
        examples[o] = [
            {
                "group": g,
                "count": len(rs),
                "expected": rs[0].get("expected"),
                "replay": f"{cmd} {rs[0]['i']}",
                "examples": rs[:5],
            }
            for g, rs in sorted(groups[o].items(), key=lambda kv: -len(kv[1]))
        ]
    raw = groups["raw_exception"]
    print(f"\nraw exception sites ({len(raw)})")
    for g, rs in sorted(raw.items(), key=lambda kv: -len(kv[1])):
        print(
            f"  {len(rs):5d}  {g}\n         e.g. case {rs[0]['i']}: {rs[0]['kind']} {rs[0]['target']} -> {rs[0]['reader']}: {rs[0]['message'][:150]!r}"
        )
    for o in ("silently_different", "error_unnamed", "resource", "crash"):
        gs = groups[o]
        findings = sorted(((g, rs) for g, rs in gs.items() if not rs[0].get("expected")), key=lambda kv: -len(kv[1]))
        by_design = Counter()
        for rs in gs.values():
            for r in rs:
                if r.get("expected"):
                    by_design[f"{r['reader']} | {r['target']} | {r['expected']}"] += 1
        print(
            f"\n{o}: {sum(map(len, gs.values()))} cases; {sum(len(rs) for _, rs in findings)} in {len(findings)} groups are findings, "
            f"{sum(by_design.values())} by design"
        )
        for g, rs in findings:
            r0 = rs[0]
            info = r0.get("difference") or r0.get("message", "")[:160] or r0.get("resource") or r0.get("crash") or ""
            named = f" names {r0['named']}" if r0.get("named") else ""
            what = r0.get("mutation", {}).get("ops") or r0.get("mutation", {}) or ""
            kinds = ", ".join(f"{k} x{n}" for k, n in Counter(r["kind"] for r in rs).most_common(4))
            print(
                f"  {len(rs):5d}  {g}\n         kinds: {kinds}\n         e.g. case {r0['i']} ({r0['kind']}): {str(what)[:300]} -> {info!r}{named}"
            )
        for g, n in by_design.most_common():
            print(f"  {n:5d}  by design: {g}")
    audit = [(r["i"], r["audit"]) for r in recs if r.get("audit")]
    reads = Counter(p for r in recs for p in r.get("reads_outside", []))
    sentinel = (work / SENTINEL_NAME).exists() or any(r.get("sentinel") for r in recs)
    cwd_files = sorted(os.listdir(work / "cwd")) if (work / "cwd").is_dir() else []
    print(
        f"\nsafety: sentinel created: {sentinel}; audit events (writes outside scratch, spawns): {len(audit)}; "
        f"source runs unchanged: {digests_ok}; files left in the worker's cwd: {len(cwd_files)}"
    )
    if reads:
        print(
            "reads outside the scratch folder (information): " + ", ".join(f"{p} x{n}" for p, n in reads.most_common(8))
        )
    print(f"\nwall time {wall:.0f} s ({wall / 60:.1f} min), {1000 * wall / max(1, len(recs)):.0f} ms per case")
    return {
        "command": " ".join(
            [
                os.path.relpath(sys.executable, REPO) if sys.executable.startswith(str(REPO)) else sys.executable,
                os.path.relpath(__file__, REPO),
                *sys.argv[1:],
            ]
        ),
        **env,
        "cases": len(recs),
        "seed": args.seed,
        "heavy": args.heavy,
        "wall_seconds": round(wall, 1),
        "counts": {o: totals[o] for o in OUTCOMES},
        "by_kind": tables["kind"],
        "by_reader": tables["reader"],
        "by_target": tables["target"],
        "safety": {
            "sentinel_created": sentinel,
            "audit_events": audit[:50],
            "source_runs_unchanged": digests_ok,
            "cwd_files": cwd_files,
            "reads_outside_scratch": dict(reads.most_common(50)),
        },
        "raw_exception_sites": sorted(raw, key=lambda g: -len(raw[g])),
        "non_clear": examples,
        **extra,
    }


# ------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="benchmarks/harnesses/fuzz.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cases", type=int, default=20000, help="number of cases (default 20000)")
    p.add_argument("--seed", type=int, default=0, help="seed; case i depends only on (seed, i)")
    p.add_argument(
        "--work",
        default="/tmp/nws-fuzz",
        help="work folder: cached runs, scratch copies, cases.jsonl (default /tmp/nws-fuzz)",
    )
    p.add_argument("--out", default=None, help="raw JSON result (e.g. benchmarks/results/fuzz.json)")
    p.add_argument(
        "--heavy",
        type=float,
        default=3.0,
        help="weight multiplier of the slow readers (load, runtime, summary, analyse, export)",
    )
    p.add_argument(
        "--slow",
        type=float,
        default=20.0,
        help="a case longer than this many seconds is a resource outcome (default 20)",
    )
    p.add_argument(
        "--rss-gib", type=float, default=1.0, help="peak RSS growth that makes a resource outcome (default 1 GiB)"
    )
    p.add_argument("--alarm", type=int, default=60, help="per-case signal.alarm in seconds (default 60)")
    p.add_argument(
        "--hard-timeout",
        type=float,
        default=180,
        help="the supervisor kills a worker stuck this long in one case (default 180 s)",
    )
    p.add_argument(
        "--kill-gib",
        type=float,
        default=8.0,
        help="the supervisor kills a worker whose RSS passes this (default 8 GiB)",
    )
    p.add_argument(
        "--mem-limit-gib",
        type=float,
        default=4.0,
        help="RLIMIT_AS headroom of the worker over its start size (0: none)",
    )
    p.add_argument(
        "--lib-rev",
        default=None,
        metavar="REV",
        help="fuzz the library as of git revision REV (git archive into WORK/lib, put first on PYTHONPATH) instead of "
        "the installed working tree, which may change while the benchmark runs",
    )
    p.add_argument(
        "--resume", action="store_true", help="keep the cases already in WORK/cases.jsonl (same seed and heavy)"
    )
    p.add_argument(
        "--replay", type=int, default=None, metavar="I", help="run case I alone, verbosely, and keep its scratch copy"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.passthrough = [
        "--cases",
        str(args.cases),
        "--seed",
        str(args.seed),
        "--work",
        args.work,
        "--heavy",
        str(args.heavy),
        "--slow",
        str(args.slow),
        "--rss-gib",
        str(args.rss_gib),
        "--alarm",
        str(args.alarm),
        "--mem-limit-gib",
        str(args.mem_limit_gib),
    ]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    work = Path(args.work).resolve()
    if args.worker:
        worker_main(args)
        return
    work.mkdir(parents=True, exist_ok=True)
    (work / "cwd").mkdir(exist_ok=True)
    lib_commit = pin_library(args.lib_rev, work)[0] if args.lib_rev else None
    lib_before = library_digest(sys.executable)
    runs = train_runs(work, sys.executable, lib_commit or f"installed {lib_before[1]}")
    if args.replay is not None:
        os.chdir(work / "cwd")
        w = Worker(args, runs)
        rec = w.run_case(args.replay, verbose=True)
        print(json.dumps({k: v for k, v in rec.items() if k != "mutation"}, indent=2, default=repr))
        return
    before = {name: tree_digest(d) for name, d in runs.items()}
    sentinel = work / SENTINEL_NAME
    if sentinel.exists():
        sentinel.unlink()
    if not args.resume:
        for f in ("cases.jsonl", "state.json", "wall.json"):
            (work / f).unlink(missing_ok=True)
    print(
        f"fuzzing {args.cases} cases (seed {args.seed}) in {work}; library {lib_commit or 'installed'} at {lib_before[0]}; one worker process",
        flush=True,
    )
    wall = supervise(args, work)
    walls = json.loads((work / "wall.json").read_text()) if args.resume and (work / "wall.json").is_file() else []
    walls.append(round(wall, 1))
    (work / "wall.json").write_text(json.dumps(walls))
    wall = sum(walls)  # a resumed run reports the time of every invocation
    digests_ok = {name: tree_digest(d) for name, d in runs.items()} == before
    lib_after = library_digest(sys.executable)
    if lib_after != lib_before:
        print(
            "WARNING: the library's code changed while the benchmark ran: results mix versions (pin one with --lib-rev)",
            flush=True,
        )
    result = report(
        args,
        work,
        wall,
        digests_ok,
        {"work": str(work), "wall_seconds_per_invocation": walls},
        environment(lib_commit, lib_before, lib_after),
    )
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=repr) + "\n")
        print(f"raw results: {out}")


if __name__ == "__main__":
    main()
