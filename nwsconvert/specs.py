"""Model specs: the string + kwargs a run directory records to rebuild its model.

A spec is ``"timm:<name>"`` (``timm.create_model``), ``"torchvision:<name>"``
(``torchvision.models.get_model``) or ``"<module>:<callable>"`` for a user's
own model factory. Weights are never downloaded: timm models are built with
``pretrained=False`` and torchvision models with ``weights=None``; pretrained
weights reach a run through its pool file and task packs.
"""

from __future__ import annotations

import importlib

from torch import nn

__all__ = ["build_model", "parse_spec"]


def parse_spec(spec: str) -> tuple[str, str]:
    """``"timm:resnet18"`` -> ``("timm", "resnet18")``.

    Raises:
        ValueError: no ``source:name`` form.
    """
    source, sep, name = spec.partition(":")
    if not sep or not source or not name:
        raise ValueError(
            f"model spec {spec!r} is not of the form 'timm:<name>', 'torchvision:<name>' or '<module>:<callable>'"
        )
    return source, name


def build_model(spec: str, **kwargs) -> nn.Module:
    """Build the (randomly initialised) model a spec names.

    Args:
        spec: see the module docstring.
        **kwargs: passed to the factory (``num_classes``, ``in_chans``...).

    Raises:
        ValueError: unknown source or model name (the message names the spec).
    """
    source, name = parse_spec(spec)
    if source == "timm":
        import timm

        if not timm.is_model(name):
            raise ValueError(f"model spec {spec!r}: timm has no model {name!r} (see timm.list_models())")
        return timm.create_model(name, pretrained=False, **kwargs)
    if source == "torchvision":
        import torchvision

        if name not in torchvision.models.list_models():
            raise ValueError(f"model spec {spec!r}: torchvision has no model {name!r} (see torchvision.models.list_models())")
        if "in_chans" in kwargs:
            raise ValueError(f"model spec {spec!r}: torchvision models take 3-channel input (no in_chans)")
        return torchvision.models.get_model(name, weights=None, **kwargs)
    try:
        factory = getattr(importlib.import_module(source), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"model spec {spec!r}: cannot import {name!r} from {source!r} ({e})") from None
    try:
        return factory(**kwargs)
    except TypeError as e:
        raise ValueError(
            f"model spec {spec!r}: {name}(**{kwargs}) failed ({e}); record a factory that needs only these "
            "arguments (model_spec=...), or pass the unconverted model itself (nwsconvert.load(..., model=...))"
        ) from None
