import os

import pytest
import torch

# CI machines have 2 cores; keep intra-op threads at the core count, shared among pytest-xdist's workers
# (`make test` runs two: one intra-op thread each, no oversubscription).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))

# Without CUDA, Triton kernels run in Triton's interpreter on CPU tensors (tests/test_fused_search.py).
# Set before any test imports a kernel module: triton.jit reads it when a kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The GPU tests that compare runs bit for bit take deterministic kernels (deterministic=true); cuBLAS
# reads its workspace setting when a handle is made, which an earlier test in this process may do.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu`` tests skip, with the reason, where CUDA is not available."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
