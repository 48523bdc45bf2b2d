"""Model specs: the string + kwargs a run directory records to rebuild its model.

A spec is ``"timm:<name>"`` (``timm.create_model``), ``"torchvision:<name>"``
(``torchvision.models.get_model``) or ``"<module>:<callable>"`` for a user's
own model factory. Weights are never downloaded: timm models are built with
``pretrained=False`` and torchvision models with ``weights=None``; pretrained
weights reach a run through its pool file and task packs (a run that starts from a user's dense
checkpoint loads it once, before conversion: ``nws-train weights=FILE``, :mod:`nwsconvert.train.weights`).

Trust: a spec read from a run directory or bundle is data from whoever wrote
it. ``timm:`` and ``torchvision:`` specs and the factories of the zoo's
pretrained entries only pick a registered architecture and are always built; a ``<module>:<callable>`` spec imports and calls code,
so it is built only with ``trust_code=True`` (``--trust-code`` on the command
lines), in the spirit of ``trust_remote_code``. Keyword arguments that would
load files or weights (``checkpoint_path``, ``pretrained``, ``weights``...)
are refused whatever the trust.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ..errors import UntrustedCodeError

if TYPE_CHECKING:  # torch loads only when a model is built: the command lines check specs before that
    from torch import nn

__all__ = ["build_model", "registry_problem", "parse_spec", "is_registry_spec", "LOADING_KWARGS"]

#: Factory arguments that load files or weights: never taken from a spec's kwargs.
LOADING_KWARGS = (
    "pretrained",
    "checkpoint_path",
    "pretrained_cfg",
    "pretrained_cfg_overlay",
    "cache_dir",
    "weights",
    "weights_backbone",
    "progress",
)


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


ZOO_MODULE = "nwsconvert.zoo.pretrained"


def is_registry_spec(spec: str) -> bool:
    """Whether ``spec`` names a registered architecture: timm, torchvision, or a factory of a
    :mod:`nwsconvert.zoo` pretrained entry. Such specs run no code but the libraries' own."""
    source = spec.partition(":")[0]
    if source in ("timm", "torchvision"):
        return True
    if source == ZOO_MODULE:
        from nwsconvert.zoo.pretrained import get_pretrained, list_pretrained

        return spec in {get_pretrained(name).spec for name in list_pretrained()}
    return False


def registry_problem(spec: str, kwargs: dict) -> str | None:
    """Why a ``timm:`` / ``torchvision:`` spec cannot be built with ``kwargs`` as the registry sees it (an
    unknown name, ``in_chans`` for torchvision), or ``None``; other specs are not checked here."""
    source, name = parse_spec(spec)
    if source == "timm":
        import timm

        if not timm.is_model(name):
            return f"model spec {spec!r}: timm has no model {name!r} (see timm.list_models())"
    elif source == "torchvision":
        import torchvision

        if name not in torchvision.models.list_models():
            return f"model spec {spec!r}: torchvision has no model {name!r} (see torchvision.models.list_models())"
        if "in_chans" in kwargs:
            return f"model spec {spec!r}: torchvision models take 3-channel input (no in_chans)"
    return None


def build_model(spec: str, *, trust_code: bool = False, **kwargs) -> nn.Module:
    """Build the (randomly initialised) model a spec names.

    Args:
        spec: see the module docstring.
        trust_code: allow a ``<module>:<callable>`` spec to import and call its code.
        **kwargs: passed to the factory (``num_classes``, ``in_chans``...).

    Raises:
        UntrustedCodeError: a ``<module>:<callable>`` spec without ``trust_code``.
        ValueError: unknown source or model name, or a kwarg that loads files (the message names the spec).
    """
    source, name = parse_spec(spec)
    loading = sorted(k for k in kwargs if k in LOADING_KWARGS)
    if loading:
        raise ValueError(
            f"model spec {spec!r}: keyword argument(s) {loading} would load files or weights; runs never do"
        )
    if not trust_code and not is_registry_spec(spec):
        raise UntrustedCodeError(
            f"model spec {spec!r} would import and call {name!r} from module {source!r}: pass trust_code=True "
            "(command lines: --trust-code) only if you trust who wrote this run, or pass the model itself (model=...)"
        )
    why = registry_problem(spec, kwargs)
    if why is not None:
        raise ValueError(why)
    if source == "timm":
        import timm

        return timm.create_model(name, pretrained=False, **kwargs)
    if source == "torchvision":
        import torchvision

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
