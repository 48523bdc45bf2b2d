"""What every nwsconvert command line shares: one-line errors, exit codes, ``--debug``.

Exit codes: 0 done; 2 a usage error (a bad value, a path that is not what
the command needs: nothing was started); 1 a failure while working (a
damaged file, a full disk, another process writing the run); 130 interrupted.
A failure is one line on stderr, and so is a warning (``prog: warning: ...``);
``--debug`` (or ``NWS_DEBUG=1``) shows the traceback, and warnings with their
source line, instead. Imports nothing heavy.
"""

from __future__ import annotations

import errno
import os
import sys
import warnings
from collections.abc import Callable

from ..errors import NWSError, UsageError

__all__ = ["run_cli", "debug_requested", "fail"]


def debug_requested(argv: list[str] | None) -> bool:
    argv = sys.argv[1:] if argv is None else argv
    return "--debug" in argv or os.environ.get("NWS_DEBUG", "") not in ("", "0")


def fail(prog: str, message: str, code: int) -> int:
    print(f"{prog}: {message}", file=sys.stderr)
    return code


def run_cli(
    prog: str, main: Callable[[list[str] | None], int], argv: list[str] | None, *, resume_hint: str = ""
) -> int:
    """Run ``main(argv)`` and turn what it raises into one line and an exit code (see the module docstring).

    Args:
        resume_hint: what to do after a full disk (``"run --resume"``...).
    """
    if debug_requested(argv):
        return main(argv)
    with warnings.catch_warnings():  # restores the caller's warning display afterwards
        warnings.showwarning = lambda message, *_: print(f"{prog}: warning: {message}", file=sys.stderr)
        return _run(prog, main, argv, resume_hint)


def _run(prog: str, main: Callable[[list[str] | None], int], argv: list[str] | None, resume_hint: str) -> int:
    try:
        return main(argv)
    except UsageError as e:
        return fail(prog, str(e), 2)
    except KeyboardInterrupt:
        return fail(prog, "interrupted", 130)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            where = f" while writing {e.filename}" if e.filename else ""
            return fail(prog, f"disk full{where}: free space{' and ' + resume_hint if resume_hint else ''}", 1)
        if isinstance(e, FileNotFoundError) and e.filename is None:
            return fail(prog, str(e), 1)
        return fail(prog, f"{e.strerror or e}{': ' + str(e.filename) if e.filename else ''}", 1)
    except NWSError as e:
        return fail(prog, str(e), 1)
    except MemoryError:
        return fail(prog, "out of memory (a smaller batch_size, or device=cpu?)", 1)
    except Exception as e:  # anything else is a bug of ours or of a library: one line, the traceback on request
        return fail(prog, f"{type(e).__name__}: {e} (run again with --debug for the traceback)", 1)
