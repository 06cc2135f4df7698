"""Pretrain BDH with DeepSpeed's ZeRO engine (stages 0-3, fp32 or bf16, optional CPU offload).

    torchrun --nproc_per_node 2 recipes/pretrain.py --deepspeed ds_configs/zero2.json \
        --output_dir runs/x
    deepspeed --num_gpus 8 recipes/pretrain.py --deepspeed ds_configs/zero3.json --bf16 \
        --output_dir runs/x
    accelerate launch --config_file launch/accelerate/zero2.yaml recipes/pretrain.py \
        --output_dir runs/x

Top to bottom: inputs (all checked before any process group starts), the model, the DeepSpeed
engine with the retention hook on its save_checkpoint, then the loop: batch, forward, backward,
step, the DiLoCo outer step, logging, evaluation, save; then the export. dragon.run.loop.TrainingRun
keeps the bookkeeping (data streams, resume, metrics, checkpoint contents).
"""

from typing import Optional

import deepspeed
import torch

from dragon.model.attention import BDHCache
from dragon.diloco.outer import DiLoCo
from dragon.parallel.distributed import all_reduce_mean, init_distributed, rank, world_size
from dragon.checkpoint.export import export_engine
from dragon.run.loop import TrainingRun, initial_model
from dragon.run.metrics import RECORDED_METRICS, metrics_path, grad_norm_before_step, setup_logging
from dragon.run.optim import client_optimizer_and_scheduler
from dragon.run.preflight import preflight
from dragon.checkpoint.retention import attach_retention
from dragon.parallel.topology import enter_island


@torch.no_grad()
def evaluate(engine, batches, cache: Optional[BDHCache] = None) -> float:
    """Mean validation loss over every rank's fixed batches; with a cache each batch continues
    the state the batches before it left (streams)."""
    engine.eval()
    losses = []
    for batch in batches:
        batch = batch.to(engine.device)
        losses.append(engine(input_ids=batch, labels=batch, cache=cache).loss.item())
    engine.train()
    return all_reduce_mean([sum(losses) / len(losses)])[0]


def main():
    setup_logging()
    inputs = preflight()
    args = inputs.train
    # With DiLoCo each island is a torch.distributed world of its own, entered before DeepSpeed.
    topology = enter_island(inputs.diloco, args.dist_timeout)
    init_distributed(args.dist_timeout)
    model = initial_model(inputs)

    optimizer, lr_scheduler = client_optimizer_and_scheduler(
        model.parameters(), inputs.ds_config, args
    )
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        model_parameters=model.parameters(),
        config=inputs.ds_config,
    )
    if args.torch_compile:
        engine.compile()
    # Every engine.save_checkpoint is followed by a completion marker and pruning: the last
    # --save_total_limit checkpoints plus the best by --metric_for_best_model in metrics.jsonl.
    attach_retention(
        engine,
        args.retention_policy(),
        RECORDED_METRICS,
        history_path=metrics_path(inputs.run_dir(topology.island)),
    )
    outer = DiLoCo.from_engine(engine, inputs.diloco, topology)  # None unless --diloco_inner_steps
    run = TrainingRun(
        engine, inputs, model.config, topology, dp_rank=rank(), dp_world=world_size(), diloco=outer
    )

    engine.train()
    while not run.done:
        losses = []
        caches = run.step_caches()  # with --carry_state each micro-batch's rows continue a state
        for micro_step in range(run.accum):
            batch = next(run.train_batches).to(engine.device)
            loss = engine(input_ids=batch, labels=batch, cache=caches[micro_step]).loss
            engine.backward(loss)
            if micro_step == run.accum - 1:
                unclipped_norm = grad_norm_before_step(engine)  # only ZeRO-0 fp32 needs it
            engine.step()  # DeepSpeed steps the optimizer only at the accumulation boundary
            losses.append(loss.item())
        step = run.end_step(sum(losses) / len(losses))
        grad_norm = engine.get_global_grad_norm() or unclipped_norm
        # A preemption signal or a non-finite step, as every rank sees it (the update of a
        # non-finite step is not applied).
        verdict = run.check(grad_norm)

        record = outer.maybe_outer_step(step, final=run.done) if outer else {}
        if run.due(args.logging_steps):
            record.update(run.train_metrics(grad_norm))
        if run.due(args.eval_steps):
            record["eval_loss"] = evaluate(engine, run.valid_batches)
            if run.valid_streams:
                streams = BDHCache(model.config.n_layer)
                record["eval_loss_carried"] = evaluate(engine, run.valid_streams, streams)
        run.log(record)
        # With DiLoCo, save_steps is a multiple of H (an outer step); a preemption waits for one.
        if run.due(args.save_steps) or verdict.save:
            run.save()
        if verdict.stop:
            run.stop(verdict)

    run.finish(
        lambda out_dir: export_engine(engine, model.config, out_dir, run.last_checkpoint),
        topology.island,
    )


if __name__ == "__main__":
    main()
