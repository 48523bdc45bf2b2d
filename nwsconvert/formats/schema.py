"""A small typed layer over JSON headers: every field is checked for type and range before it is used.

    f = Fields(header, "task_0.nwspack")
    n = f.int("num_classes", lo=1, optional=True)
    for i, row in enumerate(f.list("layers")):
        r = f.sub(row, f"layers[{i}]")
        r.int("count", lo=0, hi=MAX_KERNELS)

Every failure is a :class:`~nwsconvert.errors.FormatError` whose message names
the file and the field (``task_0.nwspack: field layers[3].count: expected an
integer in [0, 268435456], got 'abc'``). Imports nothing heavy.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath, PureWindowsPath
from typing import Literal, overload

from ..errors import FormatError

__all__ = ["Fields", "MISSING", "SHA256", "is_plain_name", "is_relative_inside"]

SHA256 = re.compile(r"[0-9a-f]{64}")
MISSING = object()


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def is_plain_name(name) -> bool:
    """A file name with no folder part: no separator, not ``.``/``..``, not empty, no NUL."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
        and ":" not in name
    )


def is_relative_inside(rel) -> bool:
    """A relative path that stays inside its folder by its text alone (no ``..``, not absolute, no drive)."""
    if not isinstance(rel, str) or not rel or "\0" in rel or "\\" in rel:
        return False
    if PurePosixPath(rel).is_absolute() or PureWindowsPath(rel).drive or PureWindowsPath(rel).is_absolute():
        return False
    return all(part not in ("..", "") for part in rel.split("/")) and not rel.startswith("./..")


class Fields:
    """Typed, range-checked access to one JSON object of ``file``.

    Args:
        obj: the object (anything else raises).
        file: the file named in errors.
        where: the object's place in the file (``layers[3]``), named in errors.
    """

    def __init__(self, obj, file, where: str = ""):
        self.file, self.where = file, where
        if not isinstance(obj, dict):
            raise FormatError(
                f"{file}: {'field ' + where if where else 'header'}: expected a JSON object, got {_show(obj)}"
            )
        self.obj = obj

    def _name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def fail(self, key: str, expected: str, value) -> FormatError:
        return FormatError(f"{self.file}: field {self._name(key)}: expected {expected}, got {_show(value)}")

    def sub(self, obj, where: str) -> Fields:
        return Fields(obj, self.file, self._name(where) if self.where else where)

    def get(self, key: str, optional: bool, default):
        if key in self.obj:
            return self.obj[key], True
        if optional:
            return default, False
        raise FormatError(f"{self.file}: field {self._name(key)} is missing")

    def int(self, key: str, *, lo: int | None = None, hi: int | None = None, optional: bool = False, default=None):
        value, present = self.get(key, optional, default)
        if not present or (optional and value is None):
            return value
        if type(value) is not int or (lo is not None and value < lo) or (hi is not None and value > hi):
            rng = (
                f" in [{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
                if lo is not None or hi is not None
                else ""
            )
            raise self.fail(key, f"an integer{rng}", value)
        return value

    def number(self, key: str, *, optional: bool = False, default=None):
        value, present = self.get(key, optional, default)
        if not present or (optional and value is None):
            return value
        if type(value) not in (int, float):
            raise self.fail(key, "a number", value)
        return value

    def bool(self, key: str, *, optional: bool = False, default=None):
        value, present = self.get(key, optional, default)
        if not present or (optional and value is None):
            return value
        if type(value) is not bool:
            raise self.fail(key, "true or false", value)
        return value

    def str(self, key: str, *, choices=None, pattern: re.Pattern | None = None, optional: bool = False, default=None):
        value, present = self.get(key, optional, default)
        if not present or (optional and value is None):
            return value
        if (
            not isinstance(value, str)
            or (choices is not None and value not in choices)
            or (pattern is not None and not pattern.fullmatch(value))
        ):
            what = (
                f"one of {', '.join(map(repr, choices))}"
                if choices is not None
                else "a SHA-256 (64 hex digits)"
                if pattern is SHA256
                else "a string"
            )
            raise self.fail(key, what, value)
        return value

    def sha(self, key: str, *, optional: bool = False):
        return self.str(key, pattern=SHA256, optional=optional)

    def list(self, key: str, *, optional: bool = False, default=None, max_len: int | None = None) -> list:
        value, present = self.get(key, optional, default)
        if not present or (optional and value is None):
            return value
        if not isinstance(value, list) or (max_len is not None and len(value) > max_len):
            raise self.fail(key, "a list" + (f" of at most {max_len} entries" if max_len is not None else ""), value)
        return value

    def ints(
        self,
        key: str,
        *,
        lo: int | None = None,
        hi: int | None = None,
        optional: bool = False,
        max_len: int | None = None,
    ) -> list:
        value = self.list(key, optional=optional, max_len=max_len)
        if value is None:
            return value
        if not all(type(v) is int and (lo is None or v >= lo) and (hi is None or v <= hi) for v in value):
            raise self.fail(key, f"a list of integers{f' >= {lo}' if lo is not None else ''}", value)
        return value

    def strs(self, key: str, *, optional: bool = False) -> list:
        value = self.list(key, optional=optional)
        if value is None:
            return value
        if not all(isinstance(v, str) for v in value):
            raise self.fail(key, "a list of strings", value)
        return value

    def dict(self, key: str, *, optional: bool = False, default=None) -> dict:
        value, present = self.get(key, optional, default)
        if not present or (optional and value is None):
            return value
        if not isinstance(value, dict):
            raise self.fail(key, "a JSON object", value)
        return value

    @overload
    def obj_fields(self, key: str) -> Fields: ...
    @overload
    def obj_fields(self, key: str, *, optional: Literal[True]) -> Fields | None: ...
    def obj_fields(self, key: str, *, optional: bool = False) -> Fields | None:
        """The object at ``key`` as :class:`Fields` (None when ``optional`` and absent or null)."""
        value = self.dict(key, optional=optional)
        return None if value is None else Fields(value, self.file, self._name(key))

    def filename(self, key: str, *, optional: bool = False):
        """A plain file name (no folder part): files a header names stay beside it."""
        value, present = self.get(key, optional, None)
        if not present or (optional and value is None):
            return value
        if not is_plain_name(value):
            raise self.fail(key, "a plain file name in the same folder (no '/', '\\' or '..')", value)
        return value

    def relpath(self, key: str, *, optional: bool = False):
        """A relative path that stays inside the file's folder (no ``..``, not absolute)."""
        value, present = self.get(key, optional, None)
        if not present or (optional and value is None):
            return value
        if not is_relative_inside(value):
            raise self.fail(key, "a relative path inside the directory (no '..', not absolute)", value)
        return value
