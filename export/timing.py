"""What a task switch costs as a user sees it: the first run after the switch minus a steady run.

    costs = switch_costs(rt, images, cycles=5)     # seconds, one per switch (round robin over every task)
    summary(costs)                                   # {"median", "q25", "q75", "n"}

Used by ``nws-infer --bench`` and ``benchmarks/deploy_modes.py``. NumPy and the standard library only.
"""

from __future__ import annotations

import time

import numpy as np

__all__ = ["interleaved_times", "switch_costs", "run_times", "summary"]


def _timed(fn) -> float:
    tic = time.perf_counter()
    fn()
    return time.perf_counter() - tic


def switch_costs(runtime, images, cycles: int = 5, tasks: list[int] | None = None) -> list[float]:
    """Switch costs over a round robin of ``tasks`` (default every task), ``cycles`` times.

    Each task is run twice in a row right after the previous task ran: the first run pays for the switch,
    the second is a steady run of the same task; their difference is the switch's cost (it includes what
    a first run after new weights costs, such as caches). Needs at least two tasks.
    """
    tasks = list(runtime.tasks if tasks is None else tasks)
    if len(tasks) < 2:
        raise ValueError("a switch needs at least two tasks")
    for t in tasks:  # every task used once: start-up work is not a switch
        runtime.run(t, images)
    out = []
    for _ in range(cycles):
        for t in tasks:
            run = lambda task=t: runtime.run(task, images)  # noqa: E731
            first = _timed(run)
            steady = _timed(run)
            out.append(first - steady)
    return out


def run_times(runtime, task: int, images, rounds: int = 50) -> list[float]:
    """Seconds per run of ``task`` on ``images``, ``rounds`` runs after one warm-up run."""
    runtime.run(task, images)
    return [_timed(lambda: runtime.run(task, images)) for _ in range(rounds)]  # noqa: B023


def interleaved_times(first, second, task: int, images, rounds: int = 50) -> tuple[list[float], list[float]]:
    """Seconds per run of ``task`` on ``images`` by two runtimes (the two modes of one bundle, say), their
    runs alternating so that both see the same machine load; one warm-up run each."""
    first.run(task, images)
    second.run(task, images)
    a, b = [], []
    for _ in range(rounds):
        a.append(_timed(lambda: first.run(task, images)))  # noqa: B023
        b.append(_timed(lambda: second.run(task, images)))  # noqa: B023
    return a, b


def summary(values: list[float]) -> dict:
    """Median, quartiles and count of ``values``."""
    q25, median, q75 = np.percentile(np.asarray(values, dtype=np.float64), [25, 50, 75])
    return {"median": float(median), "q25": float(q25), "q75": float(q75), "n": len(values)}
