"""Pretrain BDH with DeepSpeed's ZeRO engine (stages 0-3, fp32 or bf16, optional CPU offload).

    torchrun --nproc_per_node 2 recipes/pretrain.py --deepspeed ds_configs/zero2.json --output_dir runs/x
    deepspeed --num_gpus 8 recipes/pretrain.py --deepspeed ds_configs/zero3.json --bf16 --output_dir runs/x
    accelerate launch --config_file launch/accelerate/zero2.yaml recipes/pretrain.py --output_dir runs/x

Top to bottom: arguments and data (checked before any process group starts), model, DeepSpeed
engine, the loop (forward, backward, step), export. The bookkeeping around the step (logging,
evaluation, checkpoints, resume) is dragon.loop.TrainingRun, shared with the pipeline recipe.
"""

import deepspeed
import torch

from dragon import checkpoint
from dragon.args import parse_recipe_args
from dragon.diloco import DiLoCo, DiLoCoArguments
from dragon.distributed import all_reduce_mean, init_distributed, rank, world_size
from dragon.ds_config import client_optimizer_and_scheduler
from dragon.loop import TrainingRun, initial_model
from dragon.metrics import grad_norm_before_step
from dragon.topology import enter_island


@torch.no_grad()
def evaluate(engine, batches) -> float:
    """Mean validation loss over every rank's fixed batches."""
    engine.eval()
    losses = []
    for batch in batches:
        batch = batch.to(engine.device)
        losses.append(engine(input_ids=batch, labels=batch).loss.item())
    engine.train()
    return all_reduce_mean([sum(losses) / len(losses)])[0]


def main():
    inputs = parse_recipe_args((DiLoCoArguments,))
    args, ds_config, diloco_args = inputs.train, inputs.ds_config, inputs.extra[0]
    topology = enter_island(diloco_args, args.dist_timeout)  # DiLoCo: each island is a world of its own
    init_distributed(args.dist_timeout)
    model = initial_model(inputs)

    optimizer, lr_scheduler = client_optimizer_and_scheduler(model.parameters(), ds_config, args)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                                           model_parameters=model.parameters(), config=ds_config)
    if args.torch_compile:
        engine.compile()

    outer = DiLoCo.from_engine(engine, diloco_args, topology)  # None unless --diloco_inner_steps
    run = TrainingRun(engine, inputs, model.config, dp_rank=rank(), dp_world=world_size(), devices=world_size(),
                      diloco=outer)
    engine.train()
    while not run.done:
        losses = []
        for micro_step in range(run.accum):
            batch = next(run.train_batches).to(engine.device)
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            if micro_step == run.accum - 1:
                unclipped_norm = grad_norm_before_step(engine)  # only ZeRO-0 fp32 needs it
            engine.step()  # DeepSpeed steps the optimizer only at the accumulation boundary
            losses.append(loss.item())
        run.end_step(sum(losses) / len(losses), engine.get_global_grad_norm() or unclipped_norm,
                     evaluate=lambda: evaluate(engine, run.valid_batches))

    run.finish(lambda out_dir: checkpoint.export_pretrained(engine, model.config, out_dir))


if __name__ == "__main__":
    main()
