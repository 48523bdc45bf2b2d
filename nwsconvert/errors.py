"""The library's exceptions: every failure nwsconvert raises on purpose is an :class:`NWSError`.

Each class also derives from the built-in exception callers caught before
(``ValueError``, ``FileExistsError``...), so ``except ValueError`` keeps working.
This module imports nothing heavy: the command lines use it before torch loads.
"""

from __future__ import annotations

__all__ = [
    "NWSError",
    "FormatError",
    "PackMismatchError",
    "UntrustedCodeError",
    "RunLockedError",
    "UsageError",
    "TaskNotFoundError",
    "RunExistsError",
]


class NWSError(Exception):
    """Base of every error nwsconvert raises on purpose; the message names the file, field or flag at fault."""


class FormatError(NWSError, ValueError):
    """A file is missing a field, truncated, corrupted, not the kind of file expected, or names a path
    outside its directory. The message names the file and, where one is at fault, the field."""


class PackMismatchError(NWSError, ValueError):
    """A pack does not fit the model, pool set, run or task it is applied to; the message names the mismatch."""


class UntrustedCodeError(NWSError, ValueError):
    """A run directory or bundle names code to import and call (a ``<module>:<callable>`` model spec)
    and the caller did not allow it (``trust_code=True``, ``--trust-code``)."""


class RunLockedError(NWSError, RuntimeError):
    """Another process is writing this run directory (it holds the run's lock)."""


class UsageError(NWSError, ValueError):
    """A value given on the command line or to a function is of the wrong type or out of range."""


class TaskNotFoundError(NWSError, KeyError):
    """A run or bundle has no task of that id (the message lists the ones it has)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class RunExistsError(NWSError, FileExistsError):
    """The directory already holds a run and the caller did not ask to resume it."""
