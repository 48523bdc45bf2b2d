"""nwsconvert.zoo: task suites (data), training recipes (paper hyperparameters).

    suite = nwsconvert.zoo.get_suite("split-mnist")
    config = nwsconvert.zoo.get_recipe("split-cifar100")
"""

from .recipes import RECIPES, get_recipe, list_recipes
from .suites import Task, TaskSuite, get_suite, list_suites, register_suite

__all__ = ["Task", "TaskSuite", "get_suite", "list_suites", "register_suite", "RECIPES", "get_recipe", "list_recipes"]
