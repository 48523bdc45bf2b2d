"""nwsconvert.export: deployment of NWS run directories (pool file, index packs, ONNX, onnxruntime).

The core (``nwsconvert``) never imports this package. Its contents arrive with
the export issue; task packs and pool files are already readable with
:class:`nwsconvert.TaskPack` and :class:`nwsconvert.PoolSet`.
"""

__all__: list[str] = []
