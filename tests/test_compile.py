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
    # TF32 off for this comparison: on CUDA, cuDNN may run the compiled graph's convolutions (Inductor lays
    # them out channels-last) on TF32 tensor cores, 2^-11 relative per product, where eager's own choice
    # for these small shapes was exact float32 (an H100 and an H200: eager 1.7e-8 from float64, compiled
    # 4.6e-6). That is a precision setting of the GPU, not what this test checks.
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            ref = model(x)
            explained = torch._dynamo.explain(model)(x)
            assert explained.graph_break_count == 0 and explained.graph_count == 1
            out = torch.compile(model)(x)
            exact = copy.deepcopy(model).double()(x.double())  # the same weights in float64: the true result
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    # Inductor fuses the convolutions' epilogues (BatchNorm, ReLU) into other kernels and sums in another
    # order, and may pick another convolution algorithm. Neither is exact, so the bound is eager's own:
    # the compiled output is no further from the float64 result than 4x eager float32 is, plus 16 float32
    # ulps of the largest output (a few roundings in another order in each of the net's layers, should
    # eager happen to be exact). A wrong weight or a dropped BatchNorm moves outputs by O(their size).
    eager_err = (ref.double() - exact).abs().max().item()
    ulp = exact.abs().max().item() * 2.0**-23
    assert (out.double() - exact).abs().max().item() <= 4 * eager_err + 16 * ulp
    torch._dynamo.reset()
