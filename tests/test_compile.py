"""torch.compile of a converted model in eval mode: one graph, the eager outputs."""

import sys

import pytest
import torch
from test_engine import small_net


@pytest.mark.skipif(sys.platform != "linux", reason="Inductor's CPU backend needs a C++ compiler; checked on Linux")
def test_compiled_eval_model_is_one_graph_with_the_eager_outputs():
    model = small_net(1).eval()
    x = torch.randn(4, 1, 8, 8, device=next(model.parameters()).device)
    with torch.no_grad():
        ref = model(x)
        explained = torch._dynamo.explain(model)(x)
        assert explained.graph_break_count == 0 and explained.graph_count == 1
        out = torch.compile(model)(x)
    # Inductor fuses the convolutions' epilogues (BatchNorm, ReLU) into other kernels: rounding, not exactness.
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()
