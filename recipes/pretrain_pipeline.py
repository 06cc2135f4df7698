"""Pretrain BDH with DeepSpeed's pipeline engine: P stages x (world / P) data-parallel ranks.

    deepspeed --num_gpus 8 recipes/pretrain_pipeline.py --pipeline_stages 2 \
        --deepspeed ds_configs/pipeline_zero1.json --gradient_accumulation_steps 8 \
        --output_dir runs/x
    torchrun --nproc_per_node 2 recipes/pretrain_pipeline.py --pipeline_stages 2 \
        --deepspeed ds_configs/pipeline_zero0.json --output_dir runs/x

BDH as a PipelineModule: an embedding stage, n_layer uses of one block of weights shared by every
stage (a TiedLayerSpec), a head. engine.train_batch runs DeepSpeed's 1F1B schedule over the
gradient_accumulation_steps micro-batches: forward, backward and step in one call.

Top to bottom: pipeline_engine, the recipe's own set-up (the model as a PipelineModule in
DeepSpeed's pipeline engine); main(), which sets the run up around it (dragon.run.setup: the
inputs, all checked before any process group starts, the run's state and the Checkpointer that
saves and resumes it), trains and exports; then the loop: batch, engine.train_batch (forward,
backward and the optimizer step in one call), the DiLoCo outer step, logging, evaluation, save. An
early end (a preemption, a failure) is an exception that run_recipe turns into one line and an
exit code.
"""

from typing import Optional

import deepspeed

from dragon.checkpoint.writes import SaveFailed
from dragon.model.attention import BDHCache
from dragon.model.sparsity import SparsityProbe
from dragon.parallel.deepspeed_fixes import (norm_on_every_rank, skip_compiling_unused_muon,
                                             skip_nonfinite_updates)
from dragon.parallel.pipeline import bdh_pipeline, carrying, stage_layer
from dragon.run.exits import end_process, run_recipe
from dragon.run.inputs import RecipeInputs, initial_model
from dragon.run.metrics import global_grad_norm, sparsity_over_ranks
from dragon.run.optim import client_optimizer_and_scheduler, parameter_groups
from dragon.run.setup import Built, set_up, tear_down


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


def pipeline_engine(inputs: RecipeInputs, run_dir: str) -> Built:
    """The model as a PipelineModule in DeepSpeed's pipeline engine, with torch's AdamW and
    transformers' schedule unless the JSON names its own (then Built.lr_schedule is None)."""
    model, pipe_args = initial_model(inputs), inputs.pipeline
    # --neuron_parallel K: each stage's K adjacent ranks split its copy of the shared block
    pipe = bdh_pipeline(model, pipe_args.pipeline_stages, pipe_args.partition_method,
                        pipe_args.activation_checkpoint_interval, inputs.layout.neurons)
    # --lr_scales, and no weight decay for biases and norms
    groups = parameter_groups(pipe, inputs.ds_config, inputs.train)
    optimizer, lr_schedule = client_optimizer_and_scheduler(groups, inputs.ds_config, inputs.train)
    skip_compiling_unused_muon(inputs.ds_config)  # DeepSpeed imports its Muon in every ZeRO run
    engine, _, _, _ = deepspeed.initialize(
        model=pipe,
        optimizer=optimizer,
        lr_scheduler=lr_schedule,
        model_parameters=groups,
        config=inputs.ds_config,
    )
    skip_nonfinite_updates(engine)  # where DeepSpeed steps torch's optimizer as it is (ZeRO-0)
    norm_on_every_rank(engine)  # bf16 neuron shares
    if inputs.train.torch_compile:
        engine.compile()  # each stage's layers, in place
    # Every stage of a data rank reads the same blocks; --carry_state keeps the attention states
    # of this stage's layers.
    return Built(engine, model.config, engine.grid.data_parallel_id,
                 engine.grid.data_parallel_size, stage_layer(pipe).layers_on_stage, lr_schedule)


def main():
    setup = set_up(pipeline_engine, pipeline=True)  # inputs, engine, data, Checkpointer, resume
    train(setup.engine, setup.run, setup.data, setup.outer, setup.checkpointer, setup.args,
          setup.profiler)
    tear_down(setup)  # the export to <output_dir>/final and a sample


def train(engine, run, data, outer, checkpointer, args, profiler) -> None:
    """The loop: batch, forward-backward-step, outer step, logging, evaluation, save, profiler."""
    pipe = engine.module  # the PipelineModule: this rank's stage
    train_data = pairs(data.train)
    while not run.done:
        if outer and not outer.trains(run.step + 1):  # --diloco_island_steps: a slower island
            step, grad_norm = run.rest(), None  # rests through some steps of each window
        else:
            # With --carry_state micro-batch m's rows continue the state in run.step_caches()[m].
            with carrying(pipe, run.step_caches()):
                # DeepSpeed's 1F1B schedule: forward and backward of every micro-batch of the
                # step, then the optimizer step (what engine.step() takes in the ZeRO recipe)
                loss = engine.train_batch(train_data)
            # The loss is averaged over the micro-batches and the data-parallel ranks already.
            step = run.end_step(loss.item())
            grad_norm = global_grad_norm(engine)  # the step's, before clipping
        # A preemption signal or a non-finite step, as every rank sees it (the update of a
        # non-finite step is not applied).
        verdict = run.check(grad_norm)

        record = outer.maybe_outer_step(step, final=run.done) if outer else {}
        if outer and outer.joined_step > step:  # it landed late, in the live islands' next one
            step, grad_norm = run.catch_up(outer.joined_step, grad_norm), None
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
        profiler.step(step)  # --profile_steps A:B: traces steps A to B, then prints its table
        if verdict.stop:
            run.stop(verdict)


if __name__ == "__main__":
    # an early end (a refusal, a preemption, a failure) exits with one line and its code
    end_process(run_recipe(main))
