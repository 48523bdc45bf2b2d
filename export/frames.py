"""Images checked at the Runtime's door, before onnxruntime sees them.

    x = check_frames(images, declared=["batch", 1, 28, 28], ort=ort, what="task 2 of bundle runs/x/export",
                     norm=lambda: "mean [0.5], std [0.25]")

A bundle's graphs take ``(B, C, H, W)`` float32 images, normalised as the bundle's metadata says. A frame of
the wrong rank, channel count or size raises one :class:`~nwsconvert.errors.UsageError` line naming the shape
the bundle expects (onnxruntime's own message is 3–4 lines and names a node). Integer images (raw ``uint8``
pixels, say) are refused with the normalisation to apply, never answered unnormalised; floating images of
another precision are converted to float32. A batch of 0 and NaN pixels pass as they are (onnxruntime answers
them). NumPy only.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from nwsconvert.errors import UsageError

__all__ = ["check_frames", "expected_shape", "fixed_chw"]


def expected_shape(declared) -> str:
    """``(B, C, H, W)`` with the declared sizes filled in: ``(B, 1, 28, 28)``."""
    names = ("B", "C", "H", "W")
    dims = [str(d) if isinstance(d, int) else (names[i] if i < 4 else "?") for i, d in enumerate(declared)]
    return f"({', '.join(dims)})"


def fixed_chw(declared) -> tuple | None:
    """The ``(C, H, W)`` every frame of a graph input declared as ``declared`` has, where only the batch is
    free (what :func:`check_frames` compares the usual frame with); ``None`` where any other size is free."""
    fixed = not isinstance(declared[0], int) and all(isinstance(d, int) for d in declared[1:])
    return tuple(declared[1:]) if fixed else None


def check_frames(images, declared, ort, what: str, norm: Callable[[], str], chw: tuple | None = None):
    """``images`` as the graph takes them: float32 C-contiguous NumPy, or the OrtValue as it is.

    Args:
        images: NumPy-like ``(B, C, H, W)`` or an ``onnxruntime.OrtValue``.
        declared: the graph input's declared shape (ints, or names for free dimensions).
        what: who expects it (named in the error): ``task 2 of bundle PATH``.
        norm: returns the normalisation the bundle's metadata gives, for the hint (called only to word an error).
        chw: :func:`fixed_chw` of ``declared``, computed once by the caller: a float32, C-ordered frame of
            that ``(C, H, W)`` is passed with one comparison (the usual frame, every run).

    Raises:
        UsageError: wrong rank or size (naming the expected ``(B, C, H, W)``), or an integer, boolean or
            non-numeric dtype (naming the normalisation to apply).
    """
    if (
        type(images) is np.ndarray
        and images.dtype == np.float32
        and chw is not None
        and images.shape[1:] == chw
        and images.flags.c_contiguous
    ):
        return images  # the usual frame
    if isinstance(images, ort.OrtValue):
        shape = tuple(images.shape())
        kind = images.data_type()
        if kind != "tensor(float)":
            raise UsageError(
                f"images: an OrtValue of {kind}, {what} takes float32 {expected_shape(declared)} images normalised as "
                f"its metadata says ({norm()})"
            )
        _check_shape(shape, declared, what)
        return images
    x = images if isinstance(images, np.ndarray) else np.asarray(images)
    if x.dtype.kind in "iub":
        raise UsageError(
            f"images are {x.dtype}: {what} takes float32 images normalised as its metadata says, not raw pixels; "
            f"scale them to [0, 1] (divide 8-bit pixels by 255), then subtract the mean and divide by the std "
            f"({norm()})"
        )
    if x.dtype.kind != "f":
        raise UsageError(f"images are {x.dtype}: {what} takes float32 {expected_shape(declared)} images")
    _check_shape(x.shape, declared, what)
    return np.ascontiguousarray(x, dtype=np.float32)


def _check_shape(shape: tuple, declared, what: str) -> None:
    fixed = all(d == n for d, n in zip(declared, shape) if isinstance(d, int))
    if len(shape) != len(declared) or not fixed:
        got = "(" + ", ".join(str(d) for d in shape) + ")"
        raise UsageError(f"images of shape {got}: {what} takes {expected_shape(declared)}")
