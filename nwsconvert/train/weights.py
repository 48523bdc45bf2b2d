"""A user's dense checkpoint as the starting point of a run: ``nws-train weights=FILE``.

The weights are loaded into the freshly built model before conversion, so the k-means pools, the
base pack and every task start from them. After that the run's pool file and packs carry
everything: reloading, exporting or evaluating a run never reads the file. ``--resume`` builds the
model as the run started, so it loads the file again (it must still be there, unchanged: the run
records the file's SHA-256 and a resume refuses another file) before
converting with the run's own pools.

Only safetensors is read (no pickle): ``safetensors.torch.save_file(model.state_dict(), path)``
writes such a file from any PyTorch model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import FormatError
from ..formats.stfile import file_kind

if TYPE_CHECKING:  # torch loads only when weights are loaded: nws-train checks the file before that
    from torch import nn

__all__ = ["load_weights", "weights_file_problem"]

_NWS_KINDS = {
    "nwsconvert.poolset": "a pool file (give it as init=FILE)",
    "nwsconvert.taskpack": "a task pack",
    "nwsconvert.train.checkpoint": "a training checkpoint (resume its run with --resume)",
}


def weights_file_problem(path: Path) -> str | None:
    """What makes ``path`` unusable as ``weights=``, worded to follow its name (``": no such file"``,
    ``" is not a safetensors file (...)"``...), or ``None`` when it is a safetensors file that is not
    an nwsconvert file. Reads only the header, without torch."""
    if not path.is_file():
        return ": no such file"
    try:
        kind = file_kind(path)  # the layout checked against the file's length
    except FormatError:
        return (
            " is not a safetensors file (torch.save / pickle files are not read: "
            "write it with safetensors.torch.save_file(model.state_dict(), path))"
        )
    if kind in _NWS_KINDS:
        return f" is {_NWS_KINDS[kind]}, not a model's state dict"
    return None


def load_weights(model: nn.Module, path: str | os.PathLike) -> list[str]:
    """Load the state dict saved in ``path`` into ``model`` (before :func:`nwsconvert.convert`).

    Every tensor of ``model.state_dict()`` must be in the file with the same shape, except the
    classifier's (:func:`~nwsconvert.train.heads.find_head`): when the file's classifier has another
    shape (another number of classes) or is absent, the model keeps its own, freshly initialised one,
    as ``timm.create_model(..., pretrained=True, num_classes=N)`` does. A tensor the model lacks is
    an error (another architecture). Values are cast to the model's dtypes.

    Args:
        model: a dense model, as built from the run's spec.
        path: a safetensors file of a state dict.

    Returns:
        The names of the model's tensors it kept (its classifier's, when the file's did not fit; else empty).

    Raises:
        FileNotFoundError: no such file.
        FormatError: not a safetensors file, or an nwsconvert file of another kind (the message names the file).
        ValueError: the file does not fit the model (the message names the file and the first tensor at fault).
    """
    from safetensors.torch import load_file

    from .heads import find_head

    path = Path(path)
    why = weights_file_problem(path)  # before anything is allocated
    if why is not None:
        raise (FormatError if path.is_file() else FileNotFoundError)(f"{path}{why}")
    tensors = load_file(str(path))
    own = model.state_dict()
    try:
        head_name, head = find_head(model)
        head_keys = {f"{head_name}.{k}" if head_name else k for k in head.state_dict()}
    except ValueError:  # no classifier: every tensor must fit
        head_keys = set()
    extra = sorted(set(tensors) - set(own) - head_keys)
    if extra:
        raise ValueError(
            f"{path}: tensor {extra[0]!r} is not in the model ({len(extra)} of the file's {len(tensors)} "
            f"tensors are not): a checkpoint of another architecture?"
        )
    body = [k for k in own if k not in head_keys]
    missing = [k for k in body if k not in tensors]
    if missing:
        raise ValueError(f"{path}: the model's tensor {missing[0]!r} is not in the file ({len(missing)} missing)")
    for k in body:
        if tuple(tensors[k].shape) != tuple(own[k].shape):
            raise ValueError(
                f"{path}: tensor {k!r} is {tuple(tensors[k].shape)} in the file, {tuple(own[k].shape)} in the model"
            )
    head_fits = all(k in tensors and tuple(tensors[k].shape) == tuple(own[k].shape) for k in head_keys)
    keep = [] if head_fits else sorted(head_keys)
    model.load_state_dict({k: v for k, v in tensors.items() if k in own and k not in keep}, strict=False)
    return keep
