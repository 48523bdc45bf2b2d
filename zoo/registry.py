"""One registry shape for the zoo: suites, recipes, presets and pretrained entries.

A :class:`Registry` is a plain ``dict`` of name -> entry that lists its names
sorted and, for an unknown name, raises a ``KeyError`` listing the known ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(dict):
    """``name -> entry`` with sorted :meth:`names`, a :meth:`lookup` that names the known entries, and a decorator.

    Args:
        kind: what an entry is, for the error (``"preset"``: "unknown preset 'x'").
        known: how the list of names is introduced (``"known presets"``).
        entries: initial entries.
    """

    def __init__(self, kind: str, known: str, entries: dict | None = None):
        super().__init__(entries or {})
        self.kind = kind
        self.known = known

    def names(self) -> list[str]:
        return sorted(self)

    def lookup(self, name: str):
        """The entry registered as ``name``.

        Raises:
            KeyError: unknown name (the message lists the known ones).
        """
        if name not in self:
            raise KeyError(f"unknown {self.kind} {name!r}; {self.known}: {', '.join(self.names())}")
        return self[name]

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: register the decorated object under ``name`` and return it unchanged."""

        def deco(obj: T) -> T:
            self[name] = obj
            return obj

        return deco
