"""Host cost of the engine's autograd path on a CPU: a forward through L tiny 3x3 convolutions with the engine
(torch kernel; compute negligible) and its backward, per step (the least of 7 rounds of 50 steps).

    python benchmarks/probes/probe_engine_autograd.py [L]

Run it against two checkouts to compare (``PYTHONPATH=CHECKOUT``, from outside the repository, alternating).
The figure is host work only: on a GPU the same Python and autograd nodes run on the host while kernels are
launched (RESULTS, "The eager GPU step's host time").
"""

import sys
import time

import torch
from torch import nn

import nwsconvert
from nwsconvert.core.engine import SearchEngine


def main() -> None:
    torch.set_num_threads(1)
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 82
    net = nwsconvert.convert(
        nn.Sequential(*[nn.Conv2d(4, 4, 3, padding=1, bias=False) for _ in range(n)]),
        pool_size=8,
        init="random",
        seed=0,
    )
    nwsconvert.set_commitment(net, 1.0)
    x = torch.randn(1, 4, 2, 2)
    rounds = []
    with SearchEngine(net, kernel="torch"):
        net.train()
        for _ in range(30):
            net(x).sum().backward()
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(50):
                net(x).sum().backward()
            rounds.append((time.perf_counter() - t0) / 50)
    print(f"{n} layers: {min(rounds) * 1e6:.0f} us a forward + backward")


if __name__ == "__main__":
    main()
