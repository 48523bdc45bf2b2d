"""nwsconvert.zoo: task suites (data), training recipes (paper hyperparameters),
conversion presets per architecture family, pretrained entries.

    suite = nwsconvert.zoo.get_suite("split-mnist")
    config = nwsconvert.zoo.get_recipe("split-cifar100")
    model = nwsconvert.zoo.apply_preset(model)                  # family guessed, converted in place
    nws, report = nwsconvert.zoo.nws_efficientnet_lite0(512)    # real ImageNet weights, k-means pools
"""

from .presets import LayerPlan, Preset, apply_preset, get_preset, list_presets, preset_for, register_preset
from .pretrained import (
    MissingPackageError,
    PretrainedEntry,
    convert_pretrained,
    efficientnet_lite0,
    get_pretrained,
    list_pretrained,
    nws_efficientnet_lite0,
    register_pretrained,
)
from .recipes import RECIPES, get_recipe, list_recipes
from .suites import Task, TaskSuite, get_suite, list_suites, register_suite

__all__ = [
    "Task",
    "TaskSuite",
    "get_suite",
    "list_suites",
    "register_suite",
    "RECIPES",
    "get_recipe",
    "list_recipes",
    "Preset",
    "LayerPlan",
    "get_preset",
    "list_presets",
    "preset_for",
    "apply_preset",
    "register_preset",
    "PretrainedEntry",
    "MissingPackageError",
    "get_pretrained",
    "list_pretrained",
    "register_pretrained",
    "convert_pretrained",
    "efficientnet_lite0",
    "nws_efficientnet_lite0",
]
