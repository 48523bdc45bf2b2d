"""nwsconvert.export: deployment bundles, ONNX graphs with Gather reconstruction, onnxruntime runtime.

    nwsconvert.export.export_bundle("runs/mnist", tasks="all", onnx=True)   # = nws-export --task all --onnx
    rt = nwsconvert.export.Runtime("runs/mnist/export")
    rt.predict(task=2, images, k=3)
"""

from .bundle import StaleBundleError, export_bundle
from .onnx_graph import export_onnx
from .runtime import Runtime

__all__ = ["export_bundle", "export_onnx", "Runtime", "StaleBundleError"]
