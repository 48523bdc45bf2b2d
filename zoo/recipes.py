"""Named training recipes: the paper's hyperparameters and the demo's budget.

cfg = nwsconvert.zoo.get_recipe("split-cifar100")            # a TrainConfig
cfg = nwsconvert.zoo.get_recipe("split-cifar100", epochs=10)  # with changes
"""

from __future__ import annotations

from nwsconvert.train.config import TrainConfig

from .registry import Registry

__all__ = ["RECIPES", "get_recipe", "list_recipes"]

RECIPES: Registry = Registry(
    "recipe",
    "known recipes",
    {
        # Paper, Split-CIFAR-100 (ResNet-18): SGD momentum 0.9, lr 0.01, beta 0.5,
        # 100 epochs per task, lr / 10 at epochs 50 and 80, batch 32, seeds 1993-1995.
        "split-cifar100": dict(
            optimizer="sgd", lr=0.01, momentum=0.9, beta=0.5, epochs=100, milestones=[50, 80], batch_size=32, seed=1993
        ),
        # Paper, CUB-to-Sketches: as above with lr 0.001 and beta 0.1.
        "cub-to-sketches": dict(
            optimizer="sgd", lr=0.001, momentum=0.9, beta=0.1, epochs=100, milestones=[50, 80], batch_size=32, seed=1993
        ),
        # Paper, VGG-16 / MobileNetV2 runs: Adam lr 0.01, lr / 10 at epoch 50.
        "paper-adam": dict(optimizer="adam", lr=0.01, beta=0.5, epochs=100, milestones=[50], batch_size=32, seed=1993),
        # make demo: split-mnist on 2 CPU cores in a few minutes (pool learning 6 epochs, 3 per task).
        "demo": dict(
            optimizer="sgd",
            lr=0.02,
            momentum=0.9,
            beta=0.5,
            epochs=3,
            pool_epochs=6,
            schedule="cosine",
            batch_size=64,
            seed=1993,
        ),
    },
)


def list_recipes() -> list[str]:
    return RECIPES.names()


def get_recipe(name: str, **changes) -> TrainConfig:
    """The :class:`~nwsconvert.TrainConfig` of a named recipe, with ``changes`` applied.

    Raises:
        KeyError: unknown recipe (the message lists the known ones).
    """
    return TrainConfig.from_dict({**RECIPES.lookup(name), **changes})
