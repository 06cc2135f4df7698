"""Pretrain BDH with DeepSpeed's pipeline engine: P stages x (world / P) data-parallel ranks.

    deepspeed --num_gpus 8 recipes/pretrain_pipeline.py --pipeline_stages 2 \
        --deepspeed ds_configs/pipeline_zero1.json --gradient_accumulation_steps 8 \
        --output_dir runs/x
    torchrun --nproc_per_node 2 recipes/pretrain_pipeline.py --pipeline_stages 2 \
        --deepspeed ds_configs/pipeline_zero0.json --output_dir runs/x

The ZeRO recipe's shape (recipes/pretrain.py) with the pipeline's step: engine.train_batch runs
DeepSpeed's 1F1B schedule over gradient_accumulation_steps micro-batches. The arguments,
metrics, checkpoints and resume are the ZeRO recipe's.
"""

from typing import Optional

import deepspeed

from dragon.model.attention import BDHCache
from dragon.diloco.outer import DiLoCo
from dragon.parallel.distributed import init_distributed
from dragon.checkpoint.export import export_engine
from dragon.run.loop import TrainingRun, initial_model
from dragon.run.metrics import RECORDED_METRICS, metrics_path, setup_logging
from dragon.run.optim import client_optimizer_and_scheduler
from dragon.parallel.pipeline import bdh_pipeline, carrying, stage_layer
from dragon.run.preflight import preflight
from dragon.checkpoint.retention import attach_retention
from dragon.parallel.topology import enter_island


def pairs(batches):
    """The pipeline engine reads (inputs, labels); the labels are the inputs, shifted in the loss.
    """
    for batch in batches:
        yield batch, batch


def evaluate(engine, batches, cache: Optional[BDHCache] = None) -> float:
    """Mean validation loss of every data-parallel rank's fixed batches, through the pipeline;
    with a cache (of this stage's layers) each batch continues the state of the ones before."""
    engine.reset_activation_shape()  # evaluation micro-batches may differ in size
    with carrying(engine.module, None if cache is None else [cache]):
        loss = engine.eval_batch(pairs(batches), num_micro_batches=len(batches))
    engine.reset_activation_shape()
    return loss.item()


def main():
    setup_logging()
    inputs = preflight(pipeline=True)
    args, pipe_args = inputs.train, inputs.pipeline
    # With DiLoCo each island is a torch.distributed world of its own, entered before DeepSpeed.
    topology = enter_island(inputs.diloco, args.dist_timeout)
    init_distributed(args.dist_timeout)
    model = initial_model(inputs)
    pipe = bdh_pipeline(
        model,
        pipe_args.pipeline_stages,
        pipe_args.partition_method,
        pipe_args.activation_checkpoint_interval,
    )

    optimizer, lr_scheduler = client_optimizer_and_scheduler(
        pipe.parameters(), inputs.ds_config, args
    )
    engine, _, _, _ = deepspeed.initialize(
        model=pipe,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        model_parameters=pipe.parameters(),
        config=inputs.ds_config,
    )
    if args.torch_compile:
        engine.compile()  # each stage's layers, in place
    # Every engine.save_checkpoint is followed by a completion marker and pruning
    # (recipes/pretrain.py).
    attach_retention(
        engine,
        args.retention_policy(),
        RECORDED_METRICS,
        history_path=metrics_path(inputs.run_dir(topology.island)),
    )
    outer = DiLoCo.from_engine(engine, inputs.diloco, topology)  # None unless --diloco_inner_steps
    run = TrainingRun(
        engine,
        inputs,
        model.config,
        topology,
        dp_rank=engine.grid.data_parallel_id,
        dp_world=engine.grid.data_parallel_size,
        diloco=outer,
        state_layers=stage_layer(pipe).layers_on_stage,
    )

    train_data = pairs(run.train_batches)
    while not run.done:
        # With --carry_state micro-batch m's rows continue the state in run.step_caches()[m].
        with carrying(pipe, run.step_caches()):
            loss = engine.train_batch(train_data)  # forward, backward, step over the micro-batches
        # The loss is already averaged over the micro-batches and the data-parallel ranks.
        step = run.end_step(loss.item())
        grad_norm = engine.get_global_grad_norm()
        verdict = run.check(grad_norm)  # preemption, non-finite steps (recipes/pretrain.py)

        record = outer.maybe_outer_step(step, final=run.done) if outer else {}
        if run.due(args.logging_steps):
            record.update(run.train_metrics(grad_norm, already_averaged=True))
        if run.due(args.eval_steps):
            record["eval_loss"] = evaluate(engine, run.valid_batches)
            if run.valid_streams:
                streams = BDHCache(stage_layer(pipe).layers_on_stage)
                record["eval_loss_carried"] = evaluate(engine, run.valid_streams, streams)
        run.log(record)
        if run.due(args.save_steps) or verdict.save:  # DiLoCo: at an outer step (pretrain.py)
            run.save()
        if verdict.stop:
            run.stop(verdict)

    run.finish(
        lambda out_dir: export_engine(engine, model.config, out_dir, run.last_checkpoint),
        topology.island,
    )


if __name__ == "__main__":
    main()
