"""nwsconvert: Neural Weight Search for any timm or torchvision CNN.

model = timm.create_model("resnet18", num_classes=5)
model = nwsconvert.convert(model, pool_size=512)   # every Conv2d / Linear -> NWS layer
print(model.nws_report)                             # layers, roles, pools, bits per index
pack = nwsconvert.extract_task(model)               # 9-bit indices + BatchNorm statistics
pack.save("task0.nwspack")
nwsconvert.pool_set(model).save("pools.safetensors")
"""

from .lazy import lazy_exports

# Public names -> the module that defines them. Imported on first use (PEP 562), so the
# command lines can check their arguments and refuse bad input before torch is loaded.
_EXPORTS = {
    "TrainConfig": "train.config",
    "ConversionError": "conversion.converter",
    "NWSConverter": "conversion.converter",
    "NWSConfig": "conversion.config",
    "LayerConfig": "conversion.config",
    "LayerPlan": "conversion.planner",
    "plan": "conversion.planner",
    "convert": "conversion.converter",
    "find_head": "train.heads",
    "resize_head": "train.heads",
    "NWSWeight": "core.layers",
    **dict.fromkeys(
        (
            "NWSLayer",
            "commitment_loss",
            "conversion_report",
            "distillation_loss",
            "ema_update",
            "is_converted",
            "load_pools",
            "materialize",
            "nws_layers",
            "pool_set",
            "reseed_unused",
            "search_stats",
            "set_commitment",
            "set_mode",
        ),
        "core.nwsmodel",
    ),
    "TaskPack": "formats.packs",
    "apply_task": "formats.packs",
    "extract_task": "formats.packs",
    "round_state_": "formats.packs",
    "PoolSet": "core.pools",
    "ConversionReport": "conversion.report",
    "NWSError": "errors",
    "FormatError": "errors",
    "PackMismatchError": "errors",
    "UntrustedCodeError": "errors",
    "RunLockedError": "errors",
    "RunExistsError": "errors",
    "TaskNotFoundError": "errors",
    "Trainer": "train.trainer",
    "evaluate": "train.evaluation",
    "load": "train.loading",
    "RunDir": "train.rundir",
    "Manifest": "train.manifest",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())


__version__ = "0.1.0"

__all__ = [
    "convert",
    "NWSConfig",
    "LayerConfig",
    "NWSConverter",
    "LayerPlan",
    "plan",
    "ConversionError",
    "ConversionReport",
    "NWSWeight",
    "NWSLayer",
    "nws_layers",
    "is_converted",
    "conversion_report",
    "commitment_loss",
    "distillation_loss",
    "set_commitment",
    "set_mode",
    "ema_update",
    "reseed_unused",
    "search_stats",
    "pool_set",
    "load_pools",
    "materialize",
    "PoolSet",
    "TaskPack",
    "extract_task",
    "round_state_",
    "apply_task",
    "PackMismatchError",
    "FormatError",
    "NWSError",
    "UntrustedCodeError",
    "RunLockedError",
    "RunExistsError",
    "TaskNotFoundError",
    "Trainer",
    "TrainConfig",
    "evaluate",
    "load",
    "RunDir",
    "Manifest",
    "find_head",
    "resize_head",
]
