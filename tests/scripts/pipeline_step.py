"""One SGD step of a 2-stage BDH pipeline, for tests/test_pipeline.py (run under torchrun).

Builds the pipeline from a Hugging Face directory, evaluates the loss on a fixed batch, takes one
SGD step (lr 1, no clipping, so the update is minus the gradient), then writes each rank's stage
weights and a DeepSpeed checkpoint.
"""

import json
import os
import sys
from datetime import timedelta

import deepspeed
import torch

from dragon import BDHForCausalLM
from dragon.parallel.distributed import end_distributed
from dragon.parallel.pipeline import EmbedStage, HeadStage, bdh_pipeline
from dragon.model.bdh import BDHLayer

out, micro_batches = sys.argv[1], int(sys.argv[2])
deepspeed.init_distributed(timeout=timedelta(seconds=120))
rank = torch.distributed.get_rank()
model = BDHForCausalLM.from_pretrained(
    os.path.join(out, "hf")
).eval()  # dropout is 0 in the test config
pipe = bdh_pipeline(model, num_stages=2)
config = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": micro_batches,
    "gradient_clipping": 0.0,
    "steps_per_print": 10**6,
}
engine, _, _, _ = deepspeed.initialize(
    model=pipe, optimizer=torch.optim.SGD(pipe.parameters(), lr=1.0), config=config
)
batches = torch.load(os.path.join(out, "batches.pt"))
loss_before = engine.eval_batch(
    iter([(b, b) for b in batches]), num_micro_batches=micro_batches
).item()
engine.reset_activation_shape()
loss_train = engine.train_batch(iter([(b, b) for b in batches])).item()

weights = {}
for module in pipe.modules():
    if isinstance(module, EmbedStage):
        weights["embed.weight"] = module.embed.weight
    elif isinstance(module, HeadStage):
        weights["lm_head"] = module.lm_head
    elif isinstance(module, BDHLayer):
        weights.update(
            {f"layer.{n}": getattr(module, n) for n in ("encoder", "encoder_v", "decoder")}
        )
torch.save(
    {k: v.detach().clone() for k, v in weights.items()},
    os.path.join(out, f"stage_weights_{rank}.pt"),
)
engine.save_checkpoint(os.path.join(out, "ckpt"), tag="after")
if rank == 0:
    with open(os.path.join(out, "losses.json"), "w") as f:
        json.dump(
            {"before": loss_before, "train": loss_train, "parts": [int(p) for p in pipe.parts]}, f
        )
end_distributed()
