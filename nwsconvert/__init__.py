"""nwsconvert: Neural Weight Search for any timm or torchvision CNN.

    model = timm.create_model("resnet18", num_classes=5)
    model = nwsconvert.convert(model, pool_size=512)   # every Conv2d / Linear -> NWS layer
    print(model.nws_report)                             # layers, roles, pools, bits per index
    pack = nwsconvert.extract_task(model)               # 9-bit indices + BatchNorm statistics
    pack.save("task0.nwspack")
    nwsconvert.pool_set(model).save("pools.safetensors")
"""

from .config import TrainConfig
from .convert import ConversionError, NWSConverter, convert
from .heads import find_head, resize_head
from .layers import NWSWeight
from .nwsmodel import (
    NWSLayer,
    commitment_loss,
    conversion_report,
    distillation_loss,
    ema_update,
    is_converted,
    load_pools,
    materialize,
    nws_layers,
    pool_set,
    reseed_unused,
    search_stats,
    set_commitment,
    set_mode,
)
from .packs import PackMismatchError, TaskPack, apply_task, extract_task
from .pools import PoolSet
from .report import ConversionReport
from .search import brute_force, nearest_two
from .storage import FormatError
from .trainer import Trainer, evaluate
from .loading import load
from .rundir import RunDir

__version__ = "0.1.0"

__all__ = [
    "convert",
    "NWSConverter",
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
    "apply_task",
    "PackMismatchError",
    "FormatError",
    "nearest_two",
    "brute_force",
    "Trainer",
    "TrainConfig",
    "evaluate",
    "load",
    "RunDir",
    "find_head",
    "resize_head",
]
