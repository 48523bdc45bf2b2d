"""Does NWS lose accuracy by starting task t from task t-1's BatchNorm and head?

``nws-train`` starts every task's BatchNorm (affine parameters, running statistics) and the head
from the model task t-1 ended as, and only the temporary weights from ``task_init``. The
frozen-backbone peers (BN + head, LoRA, Piggyback) restart every task from the pretrained model.
This probe runs ``nws-train`` with the same keys, once as it is (``--start previous``) and once
with BatchNorm and the head loaded from the base pack (the end of pool learning) for every task
(``--start base``), so that every task starts from the same point whatever came before it.

It is a probe, not a training option: measured on the hard Fashion-MNIST pairs over 3 seeds, the
base start did not help (``benchmarks/RESULTS.md``, "Why NWS misses, and what helped")::

    OMP_NUM_THREADS=1 python benchmarks/probes/probe_task_state.py --start base suite=split-fashion-mnist \\
        suite.pairs=hard suite.train_per_class=200 suite.pretrain_images=2000 seed=1993 out=/tmp/q/base
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator

from nwsconvert.cli.train import train_main
from nwsconvert.train.store import RunStore
from nwsconvert.train.trainer import Trainer


@contextlib.contextmanager
def task_start(start: str) -> Iterator[None]:
    """Inside, ``Trainer.fit_task`` loads BatchNorm and the head of task t from ``start``:
    ``previous`` (task t-1, as ``nws-train`` does) or ``base`` (the end of pool learning)."""
    if start == "previous":
        yield
        return
    fit_task = Trainer.fit_task

    def fit_from_base(self: Trainer, *args, **kwargs):
        store_entry = RunStore.enter_task_state
        self.store.enter_task_state = lambda model, task: store_entry(self.store, model, None)  # type: ignore[method-assign]
        self.store.holds = lambda model, task: False  # type: ignore[method-assign] (never the previous task's model)
        try:
            return fit_task(self, *args, **kwargs)
        finally:
            del self.store.enter_task_state
            del self.store.holds

    Trainer.fit_task = fit_from_base  # type: ignore[method-assign]
    try:
        yield
    finally:
        Trainer.fit_task = fit_task  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="every other argument goes to nws-train as it is (key=value items, --resume...): see nws-train --help",
    )
    parser.add_argument(
        "--start",
        choices=("previous", "base"),
        default="base",
        help="where task t's BatchNorm and head start: task t-1 (nws-train's rule) or the base pack",
    )
    args, keys = parser.parse_known_args(argv)
    with task_start(args.start):
        return train_main(keys)


if __name__ == "__main__":
    sys.exit(main())
