import os

import pytest
import torch

# CI machines have 2 cores; keep intra-op threads at the core count.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
