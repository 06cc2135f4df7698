"""Pretrain BDH with DeepSpeed's pipeline engine: P stages x (world / P) data-parallel ranks.

    deepspeed --num_gpus 8 recipes/pretrain_pipeline.py --pipeline_stages 2 \
        --deepspeed ds_configs/pipeline_zero1.json --gradient_accumulation_steps 8 --output_dir runs/x
    torchrun --nproc_per_node 2 recipes/pretrain_pipeline.py --pipeline_stages 2 \
        --deepspeed ds_configs/pipeline_zero0.json --output_dir runs/x

Micro-batches per step = gradient_accumulation_steps. The arguments, metrics file, checkpoints
and resume are the ZeRO recipe's (dragon.loop.TrainingRun); only the step differs:
engine.train_batch runs DeepSpeed's 1F1B schedule over the micro-batches.
"""

import os
import sys
import warnings

import deepspeed
import torch

from dragon.args import PipelineArguments, parse_recipe_args
from dragon.diloco import DiLoCo, DiLoCoArguments
from dragon.distributed import init_distributed, rank, world_size
from dragon.ds_config import client_optimizer_and_scheduler, zero_stage
from dragon.loop import TrainingRun, initial_model
from dragon.pipe import bdh_pipeline, check_pipeline, is_pipeline_checkpoint, model_from_pipeline_checkpoint
from dragon.topology import enter_island, pipeline_data_parallel


def data_parallel_world(extra, world: int) -> int:
    """Data-parallel ranks of one island (the whole world without DiLoCo)."""
    return pipeline_data_parallel(world, extra[0].pipeline_stages, extra[1].diloco_islands)


def pairs(batches):
    """The pipeline engine reads (inputs, labels); the labels are the inputs, shifted in the loss."""
    for batch in batches:
        yield batch, batch


def main():
    if os.environ.get("ACCELERATE_USE_DEEPSPEED"):
        sys.exit("error: accelerate does not drive DeepSpeed's pipeline engine; launch with "
                 "`deepspeed --num_gpus N recipes/pretrain_pipeline.py --pipeline_stages P ...` instead")
    inputs = parse_recipe_args((PipelineArguments, DiLoCoArguments), data_parallel_world)
    args, ds_config, (pipe_args, diloco_args) = inputs.train, inputs.ds_config, inputs.extra
    stages, micro_batches = pipe_args.pipeline_stages, ds_config["gradient_accumulation_steps"]
    try:
        if zero_stage(ds_config) > 1:
            raise ValueError(f"--deepspeed {args.deepspeed}: ZeRO stage {zero_stage(ds_config)} cannot shard a "
                             "pipeline's gradients; use stage 0 or 1 (ds_configs/pipeline_zero*.json)")
        if not inputs.model.model_name_or_path:
            check_pipeline(inputs.model.config(inputs.tokenizer.vocab_size), stages, pipe_args.partition_method)
    except ValueError as e:
        sys.exit(f"error: {e}")
    if micro_batches < stages:
        bubble = (stages - 1) / (micro_batches + stages - 1)
        warnings.warn(f"{micro_batches} micro-batches (gradient_accumulation_steps) for {stages} stages: "
                      f"the pipeline bubble idles {bubble:.0%} of each step; use at least {stages}")

    topology = enter_island(diloco_args, args.dist_timeout)  # DiLoCo: each island is a world of its own
    init_distributed(args.dist_timeout)
    model = initial_model(inputs)
    pipe = bdh_pipeline(model, stages, pipe_args.partition_method, pipe_args.activation_checkpoint_interval)
    optimizer, lr_scheduler = client_optimizer_and_scheduler(pipe.parameters(), ds_config, args)
    engine, _, _, _ = deepspeed.initialize(model=pipe, optimizer=optimizer, lr_scheduler=lr_scheduler,
                                           model_parameters=pipe.parameters(), config=ds_config)
    if args.torch_compile:
        engine.compile()  # each stage's layers, in place

    grid = engine.grid
    run = TrainingRun(engine, inputs, model.config, dp_rank=grid.data_parallel_id,
                      dp_world=grid.data_parallel_size, devices=world_size(),
                      diloco=DiLoCo.from_engine(engine, diloco_args, topology))  # None unless --diloco_inner_steps

    def evaluate() -> float:
        engine.reset_activation_shape()  # evaluation micro-batches may differ in size
        loss = engine.eval_batch(pairs(run.valid_batches), num_micro_batches=len(run.valid_batches))
        engine.reset_activation_shape()
        return loss.item()

    train_data = pairs(run.train_batches)
    while not run.done:
        loss = engine.train_batch(train_data)  # averaged over micro-batches and data-parallel ranks
        run.end_step(loss.item(), engine.get_global_grad_norm(), evaluate, already_averaged=True)

    def export(out_dir: str) -> None:
        # The last step always saved a checkpoint; rebuild the plain model from its layer files.
        tag_dir = os.path.join(run.save_dir, f"step{run.step}")
        if rank() == 0:
            assert is_pipeline_checkpoint(tag_dir), tag_dir
            model_from_pipeline_checkpoint(tag_dir, model.config).save_pretrained(out_dir)
        torch.distributed.barrier()

    run.finish(export)


if __name__ == "__main__":
    main()
