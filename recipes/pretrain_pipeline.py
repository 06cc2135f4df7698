"""Pretrain BDH with DeepSpeed's pipeline engine: P stages x (world / P) data-parallel ranks.

    deepspeed --num_gpus 8 recipes/pretrain_pipeline.py --pipeline_stages 2 \
        --deepspeed ds_configs/pipeline_zero1.json --gradient_accumulation_steps 8 \
        --output_dir runs/x
    torchrun --nproc_per_node 2 recipes/pretrain_pipeline.py --pipeline_stages 2 \
        --deepspeed ds_configs/pipeline_zero0.json --output_dir runs/x

BDH as a PipelineModule: an embedding stage, n_layer uses of one block of weights shared by every
stage (a TiedLayerSpec), a head. engine.train_batch runs DeepSpeed's 1F1B schedule over the
gradient_accumulation_steps micro-batches: forward, backward and step in one call.

Top to bottom: the inputs (all checked before any process group starts), the model and its
pipeline, the DeepSpeed engine, the run's state and the Checkpointer that saves and resumes it,
then the loop: batch, forward-backward-step, the DiLoCo outer step, logging, evaluation, save;
then the export. An early end (a preemption, a failure) is an exception that main() turns into
one line and an exit code.
"""

import os
from typing import Optional

import deepspeed
import torch

from dragon.checkpoint.card import write_run_files
from dragon.checkpoint.checkpointer import Checkpointer, RNGState
from dragon.checkpoint.export import export_run, print_sample
from dragon.checkpoint.retention import attach_retention
from dragon.checkpoint.writes import SaveFailed
from dragon.diloco.build import outer_loop
from dragon.model.attention import BDHCache
from dragon.model.sparsity import SparsityProbe
from dragon.parallel.distributed import (
    init_distributed,
    rank,
)
from dragon.parallel.pipeline import bdh_pipeline, carrying, norm_on_every_rank, stage_layer
from dragon.parallel.topology import enter_island
from dragon.run.data import run_data
from dragon.run.lock import check_every_rank_sees
from dragon.run.exits import end_process, run_recipe
from dragon.run.faults import skip_nonfinite_updates
from dragon.run.loop import TrainingRun
from dragon.history import metrics_path
from dragon.run.metrics import RECORDED_METRICS, setup_logging, sparsity_over_ranks
from dragon.run.optim import client_optimizer_and_scheduler
from dragon.run.inputs import initial_model
from dragon.run.preflight import preflight


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


def deepspeed_engine(pipe, inputs):
    """The pipeline in a DeepSpeed engine, with torch's AdamW and transformers' schedule unless
    the JSON names its own; and that schedule (None when the JSON's)."""
    optimizer, lr_schedule = client_optimizer_and_scheduler(
        pipe.parameters(), inputs.ds_config, inputs.train
    )
    engine, _, _, _ = deepspeed.initialize(
        model=pipe,
        optimizer=optimizer,
        lr_scheduler=lr_schedule,
        model_parameters=pipe.parameters(),
        config=inputs.ds_config,
    )
    skip_nonfinite_updates(engine)  # where DeepSpeed steps torch's optimizer as it is (ZeRO-0)
    norm_on_every_rank(engine)  # bf16 neuron shares
    if inputs.train.torch_compile:
        engine.compile()  # each stage's layers, in place
    return engine, lr_schedule


def main():
    setup_logging()
    inputs = preflight(pipeline=True)
    args, pipe_args = inputs.train, inputs.pipeline
    # With DiLoCo each island is a torch.distributed world of its own, entered before DeepSpeed.
    topology = enter_island(inputs.diloco, args.dist_timeout)
    init_distributed(args.dist_timeout)
    run_dir = inputs.run_dir(topology.island)  # <output_dir>, or <output_dir>/island<i>
    check_every_rank_sees(run_dir)  # node-local disks would split the checkpoints: refused
    model = initial_model(inputs)
    # --neuron_parallel K: each stage's K adjacent ranks split its copy of the shared block
    pipe = bdh_pipeline(model, pipe_args.pipeline_stages, pipe_args.partition_method,
                        pipe_args.activation_checkpoint_interval, inputs.layout.neurons)
    engine, lr_schedule = deepspeed_engine(pipe, inputs)
    save_dir = os.path.join(run_dir, "checkpoints")
    # Optional: after every engine.save_checkpoint, a completion marker once every rank wrote its
    # files, and pruning to the last --save_total_limit plus the best by --metric_for_best_model.
    attach_retention(engine, args.retention_policy(), RECORDED_METRICS, metrics_path(run_dir))
    outer = outer_loop(engine, inputs.diloco.config(), topology)  # None without DiLoCo

    # The run's state: this data rank's blocks (every stage of it reads the same ones), the
    # attention states of this stage's layers (--carry_state), RNG, the outer loop.
    dp_rank, dp_world = engine.grid.data_parallel_id, engine.grid.data_parallel_size
    data_rank, data_world = topology.data_shard(dp_rank, dp_world)
    data = run_data(inputs, data_rank, data_world, dp_rank, dp_world, engine,
                    stage_layer(pipe).layers_on_stage)
    shared, per_rank = data.checkpoint_pieces()
    if lr_schedule:  # the steps it was planned for: a resume keeps them
        shared["lr_schedule"] = lr_schedule
    torch.manual_seed(args.seed + topology.launch_rank)  # every rank its own dropout masks
    per_rank["rng_state"] = RNGState(args.seed + topology.launch_rank)
    if outer:
        per_rank["diloco_state"] = outer
    checkpointer = Checkpointer(engine, save_dir, shared, per_rank, args.save_async)
    target = inputs.resume_target(topology.island)
    step = checkpointer.resume(target) if target else 0
    run = TrainingRun(engine, inputs, model.config, topology, data, dp_world, step, outer)
    if inputs.diloco.diloco_join:  # elastic: take the live islands' weights, outer state, step
        run.joined(*outer.join(), resumed=target is not None)
    if rank() == 0:
        write_run_files(save_dir, inputs, model.config, topology.islands, dp_world,
                        run.run_tokens_per_step)

    train(engine, pipe, run, data, outer, checkpointer, args)
    run.close()
    if outer:
        outer.close(ended_at=run.step)  # every island is past its last outer step, on theta_outer
    if topology.island == 0:  # with DiLoCo, island 0 exports for every island
        final_dir = export_run(engine, inputs, model.config, save_dir, run.step)
        if rank() == 0 and args.sample_max_new_tokens > 0:
            print_sample(final_dir, inputs.tokenizer, args.sample_prompt,
                         args.sample_max_new_tokens)


def train(engine, pipe, run, data, outer, checkpointer, args) -> None:
    """The loop: batch, forward-backward-step, outer step, logging, evaluation, save."""
    train_data = pairs(data.train)
    while not run.done:
        # With --carry_state micro-batch m's rows continue the state in run.step_caches()[m].
        with carrying(pipe, run.step_caches()):
            loss = engine.train_batch(train_data)  # forward, backward, step over the micro-batches
        # The loss is averaged over the micro-batches and the data-parallel ranks already.
        step = run.end_step(loss.item())
        grad_norm = engine.get_global_grad_norm()
        # A preemption signal or a non-finite step, as every rank sees it (the update of a
        # non-finite step is not applied).
        verdict = run.check(grad_norm)

        record = outer.maybe_outer_step(step, final=run.done) if outer else {}
        if run.due(args.logging_steps):
            record.update(run.train_metrics(grad_norm))
        if run.due(args.eval_steps) and not verdict.stop:  # a stop saves at once
            layer = stage_layer(pipe)  # this stage's layers: the sparsity of those
            with SparsityProbe(layer, layer.layers_on_stage, layer.first_layer) as probe:
                record["eval_loss"] = evaluate(engine, data.valid)
            record["eval_bpb"] = record["eval_loss"] * data.bpb_factor  # bits per byte of the text
            # per layer, the fraction of x, y and x*y above 0
            record.update(sparsity_over_ranks(probe.fractions(), layer.attn.config.n_layer))
            if data.valid_streams:
                streams = BDHCache(stage_layer(pipe).layers_on_stage)
                record["eval_loss_carried"] = evaluate(engine, data.valid_streams, streams)
        run.log(record)
        # With DiLoCo, save_steps is a multiple of H (an outer step); a preemption waits for one.
        try:
            checkpointer.poll()  # --save_async: a save completes once every rank wrote its files
            if run.due(args.save_steps) or verdict.save:
                checkpointer.save(step)
            if verdict.stop or run.done:
                checkpointer.wait()  # a stop and the end wait for the write in flight
        except SaveFailed as failure:  # some rank could not write; `latest` is unchanged
            run.save_failed(failure)  # trains on with --save_failure continue, else stops
        if verdict.stop:
            run.stop(verdict)


if __name__ == "__main__":
    # an early end (a refusal, a preemption, a failure) exits with one line and its code
    end_process(run_recipe(main))
