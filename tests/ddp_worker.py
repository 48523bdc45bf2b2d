"""Run under ``torchrun --nproc_per_node 2``: pools + 2 tasks with DDP, then record what each rank holds."""

import json
import sys
from pathlib import Path

import torch

import nwsconvert
from nwsconvert import Trainer, extract_task, nws_layers
from nwsconvert.formats.storage import tensor_digest

sys.path.insert(0, str(Path(__file__).parent))
from trainer_utils import KWARGS, SPEC, blobs, tiny_config, tiny_model  # noqa: E402

out = Path(sys.argv[1])
torch.set_num_threads(1)
search = sys.argv[2] if len(sys.argv) > 2 else "auto"  # engine: the SearchEngine under DDP
head_epochs = int(sys.argv[3]) if len(sys.argv) > 3 else 0  # 1: the DDP wrapper is rebuilt mid-task
trainer = Trainer(
    tiny_model(),
    out / "run",
    tiny_config(search=search, head_epochs=head_epochs),
    model_spec=SPEC,
    model_kwargs=KWARGS,
    device="cpu",
    progress=False,
)
rank = trainer.dist.rank
assert trainer.dist.world_size == 2
trainer.fit_pools(blobs(64, 4, 1), blobs(16, 4, 2), num_classes=4)
for t in range(2):
    trainer.fit_task(t, blobs(64, 2, 3 + t), blobs(16, 2, 5 + t), 2)
pack = extract_task(trainer.model, state_dtype=trainer.config.state_dtype)
sha = pack.save(out / f"rank{rank}.nwspack")
indices = {l.name: l.nws.indices for l in nws_layers(trainer.model)}
(out / f"rank{rank}.json").write_text(
    json.dumps(
        {
            "indices": tensor_digest(indices),
            "pack": sha,
            "content": pack.content_sha256(),
            "pools": nwsconvert.pool_set(trainer.model).sha256,
        }
    )
)
