"""torch.compile of a converted model in eval mode: one graph, the eager outputs."""

import copy
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
        exact = copy.deepcopy(model).double()(x.double())  # the same weights in float64: the true result
    # Inductor fuses the convolutions' epilogues (BatchNorm, ReLU) into other kernels and sums in another
    # order; on CUDA, cuDNN may pick another convolution algorithm (TF32 by default: 2^-11 relative per
    # product). Neither is exact, so the bound is eager's own: the compiled output is no further from the
    # float64 result than 4x eager float32 is (plus one float32 ulp of the largest output, should eager
    # happen to be exact). A wrong weight or a dropped BatchNorm moves outputs by O(their size).
    eager_err = (ref.double() - exact).abs().max().item()
    ulp = exact.abs().max().item() * 2.0**-23
    assert (out.double() - exact).abs().max().item() <= 4 * eager_err + ulp
    torch._dynamo.reset()
