"""nwsconvert.export: deployment bundles, ONNX graphs with Gather reconstruction, onnxruntime runtime.

    nwsconvert.export.export_bundle("runs/mnist", tasks="all", onnx=True)   # = nws-export --task all --onnx
    rt = nwsconvert.export.Runtime("runs/mnist/export")
    rt.predict(2, images, k=3)

Names are imported on first use: ``Runtime`` and the bundle reader need
neither torch nor timm, so a robot that only runs bundles never loads them.
"""

from nwsconvert.lazy import lazy_exports

__all__ = ["export_bundle", "export_onnx", "ExportError", "Runtime", "StaleBundleError", "read_bundle"]

_EXPORTS = {
    "export_bundle": "bundle",
    "StaleBundleError": "bundle",
    "export_onnx": "onnx_graph",
    "ExportError": "onnx_graph",
    "Runtime": "runtime",
    "read_bundle": "bundlefile",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
