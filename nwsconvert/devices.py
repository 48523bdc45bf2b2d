"""Is there a CUDA GPU? Answered through the driver library, without importing torch.

The command lines check ``device=cuda`` before they load torch, and the
onnxruntime ``Runtime`` never loads torch at all. ``cuInit`` and
``cuDeviceGetCount`` of ``libcuda`` give the same answer as
``torch.cuda.device_count()`` (both honour ``CUDA_VISIBLE_DEVICES``).
"""

from __future__ import annotations

import ctypes
import functools
import sys

__all__ = ["cuda_device_count", "check_device"]

_LIBS = {"win32": ("nvcuda.dll",), "darwin": ()}


@functools.lru_cache(maxsize=1)
def cuda_device_count() -> int:
    """Number of CUDA devices this process can use (0 without a driver or a GPU)."""
    for name in _LIBS.get(sys.platform, ("libcuda.so.1", "libcuda.so")):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        if lib.cuInit(0) != 0:
            return 0
        count = ctypes.c_int(0)
        return count.value if lib.cuDeviceGetCount(ctypes.byref(count)) == 0 else 0
    return 0


def check_device(device, flag: str = "device=") -> str | None:
    """Why ``device`` (``None``, ``"cpu"``, ``"cuda"``, ``"cuda:N"``) cannot be used here, or ``None`` when it can.

    ``flag``: how the command names the setting in the message (``device=`` for nws-train's key, ``--device ``
    for an option)."""
    if device is None or device == "cpu":
        return None
    if not isinstance(device, str) or not (device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        return f"{flag}{device!r}: use cpu, cuda or cuda:N (or leave it out: CUDA when present)"
    count = cuda_device_count()
    index = int(device[5:]) if ":" in device else 0
    if count == 0:
        return f"{flag}{device}: no CUDA GPU is visible here (driver missing, no GPU, or CUDA_VISIBLE_DEVICES empty); use {flag}cpu"
    if index >= count:
        return f"{flag}{device}: only {count} CUDA device(s) are visible (cuda:0..cuda:{count - 1})"
    return None
