"""Names of a package imported on first use (PEP 562), so light commands never load torch."""

from __future__ import annotations

import importlib

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: dict[str, str], namespace: dict):
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps a public name to the submodule defining it.

    A name is imported on first access and then kept in ``namespace`` (the package's globals).
    """

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        try:
            value = getattr(importlib.import_module(f".{module}", package), name)
        except ModuleNotFoundError as e:
            root = package.split(".")[0]
            if (e.name or "").split(".")[0] in ("torch", "timm", "torchvision") or (e.name or "").startswith(
                f"{root}."
            ):
                raise ModuleNotFoundError(
                    f"{package}.{name} needs the full nwsconvert install with torch (missing: {e.name}); "
                    "nwsconvert-runtime deploys bundles only: pip install nwsconvert",
                    name=e.name,
                ) from None
            raise
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
