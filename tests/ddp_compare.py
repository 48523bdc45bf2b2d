"""DDP against one process: the same global batch gives the same run.

Run under ``torchrun --nproc_per_node 2`` (each rank takes half of every global batch, gradients
averaged by DDP) or as a plain process (``--single``: the whole global batch in one process); both
write the last task's indices and temporary weights to ``OUT/<name>.safetensors``.

The model has no BatchNorm: BatchNorm normalises each rank's half batch by its own statistics, so a
network with it is not the same function of the global batch under DDP (without SyncBatchNorm)."""

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from trainer_utils import blobs, tiny_config  # noqa: E402

import nwsconvert  # noqa: E402
from nwsconvert import Trainer, nws_layers  # noqa: E402

GLOBAL_BATCH = 32


def plain_model():
    """timm's test ResNet without normalisation layers, converted (k-means pools of 32)."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("test_resnet", num_classes=4, in_chans=1, norm_layer=torch.nn.Identity)
    return nwsconvert.convert(model, pool_size=32, seed=0)


def main(out: Path, single: bool) -> None:
    torch.set_num_threads(1)
    # One global batch per epoch (the data are exactly one global batch), so both runs see the same
    # images at every step, whatever order the samplers draw them in.
    cfg = tiny_config(batch_size=GLOBAL_BATCH if single else GLOBAL_BATCH // 2, epochs=3, lr=0.05)
    trainer = Trainer(plain_model(), out / ("single" if single else "ddp"), cfg, device="cpu", progress=False)
    if not single:
        assert trainer.dist.world_size == 2
    trainer.fit_pools(blobs(GLOBAL_BATCH, 4, 1), num_classes=4)
    for t in range(2):
        trainer.fit_task(t, blobs(GLOBAL_BATCH, 2, 3 + t), blobs(16, 2, 5 + t), 2)
    if trainer.dist.rank == 0:
        tensors = {}
        for layer in nws_layers(trainer.model):
            tensors[f"{layer.name}.indices"] = layer.nws.indices.clone()
            tensors[f"{layer.name}.w"] = layer.weight.detach().clone()
        save_file(tensors, str(out / f"{'single' if single else 'ddp'}.safetensors"))
    trainer.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), "--single" in sys.argv)
