"""Files on disk, all safetensors + JSON headers and never pickle: atomic writes, the safetensors
header reader every format shares (:mod:`.stfile`), checked JSON fields (:mod:`.schema`), size
limits, task packs and their index codings (bit packing, rANS).

The torch-free modules here (everything but :mod:`.storage` and :mod:`.packs`) also ship in the
``nwsconvert-runtime`` wheel; they must not import torch.
"""
