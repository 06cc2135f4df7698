"""Pretrain BDH with DeepSpeed's ZeRO engine (stages 0-3, fp32 or bf16, optional CPU offload).

    torchrun --nproc_per_node 2 recipes/pretrain.py --deepspeed ds_configs/zero2.json \
        --output_dir runs/x
    deepspeed --num_gpus 8 recipes/pretrain.py --deepspeed ds_configs/zero3.json --bf16 \
        --output_dir runs/x
    accelerate launch --config_file launch/accelerate/zero2.yaml recipes/pretrain.py \
        --output_dir runs/x

Top to bottom: the inputs (all checked before any process group starts), the model, the DeepSpeed
engine, the run's state and the Checkpointer that saves and resumes it, then the loop: batch,
forward, backward, step, the DiLoCo outer step, logging, evaluation, save; then the export. An
early end (a preemption, a failure) is an exception that main() turns into one line and an exit
code.
"""

import os

import deepspeed
import torch

from dragon.checkpoint.card import write_run_files
from dragon.checkpoint.checkpointer import Checkpointer, RNGState
from dragon.checkpoint.export import export_run, print_sample
from dragon.checkpoint.retention import attach_retention
from dragon.checkpoint.writes import SaveFailed
from dragon.diloco.build import outer_loop
from dragon.parallel.neurons import split_model
from dragon.parallel.distributed import (
    all_reduce_mean,
    init_distributed,
    rank,
)
from dragon.parallel.topology import enter_island
from dragon.run.data import run_data
from dragon.run.lock import check_every_rank_sees
from dragon.run.exits import end_process, run_recipe
from dragon.run.faults import skip_nonfinite_updates
from dragon.run.loop import TrainingRun
from dragon.history import metrics_path
from dragon.run.evaluation import evaluation_metrics
from dragon.run.metrics import RECORDED_METRICS, setup_logging, step_and_grad_norm
from dragon.run.optim import client_optimizer_and_scheduler
from dragon.run.inputs import initial_model
from dragon.run.preflight import preflight


def deepspeed_engine(model, inputs, neurons=None):
    """The model in a DeepSpeed engine, with torch's AdamW and transformers' schedule unless the
    JSON names its own; and that schedule (None when the JSON's). `neurons`: the groups of
    --neuron_parallel, which DeepSpeed reads as its model-parallel unit (mpu)."""
    optimizer, lr_schedule = client_optimizer_and_scheduler(
        model.parameters(), inputs.ds_config, inputs.train
    )
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=lr_schedule,
        model_parameters=model.parameters(),
        config=inputs.ds_config,
        mpu=neurons,
    )
    skip_nonfinite_updates(engine)  # where DeepSpeed steps torch's optimizer as it is (ZeRO-0)
    if inputs.train.torch_compile:
        engine.compile()
    return engine, lr_schedule


def main():
    setup_logging()
    inputs = preflight()
    args = inputs.train
    # With DiLoCo each island is a torch.distributed world of its own, entered before DeepSpeed.
    topology = enter_island(inputs.diloco, args.dist_timeout)
    init_distributed(args.dist_timeout)
    run_dir = inputs.run_dir(topology.island)  # <output_dir>, or <output_dir>/island<i>
    check_every_rank_sees(run_dir)  # node-local disks would split the checkpoints: refused
    model = initial_model(inputs)
    # --neuron_parallel K: each rank keeps N/K neurons of every head; data parallel over the rest
    neurons, dp_rank, dp_world = split_model(model, inputs.layout.neurons)
    engine, lr_schedule = deepspeed_engine(model, inputs, neurons)
    save_dir = os.path.join(run_dir, "checkpoints")
    # Optional: after every engine.save_checkpoint, a completion marker once every rank wrote its
    # files, and pruning to the last --save_total_limit plus the best by --metric_for_best_model.
    attach_retention(engine, args.retention_policy(), RECORDED_METRICS, metrics_path(run_dir))
    outer = outer_loop(engine, inputs.diloco.config(), topology)  # None without DiLoCo

    # The run's state: this rank's data (and carried attention states), RNG, the outer loop.
    data_rank, data_world = topology.data_shard(dp_rank, dp_world)
    data = run_data(inputs, data_rank, data_world, dp_rank, dp_world, engine,
                    model.config.num_hidden_layers)
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

    train(engine, run, data, outer, checkpointer, args)
    run.close()
    if outer:
        outer.close(ended_at=run.step)  # every island is past its last outer step, on theta_outer
    if topology.island == 0:  # with DiLoCo, island 0 exports for every island
        final_dir = export_run(engine, inputs, model.config, save_dir, run.step)
        if rank() == 0 and args.sample_max_new_tokens > 0:
            print_sample(final_dir, inputs.tokenizer, args.sample_prompt,
                         args.sample_max_new_tokens)


def train(engine, run, data, outer, checkpointer, args) -> None:
    """The loop: batch, forward, backward, step, outer step, logging, evaluation, save."""
    engine.train()
    while not run.done:
        losses = []
        caches = run.step_caches()  # with --carry_state each micro-batch's rows continue a state
        for micro_step in range(run.accum):
            batch = next(data.train).to(engine.device)
            loss = engine(input_ids=batch, labels=batch, cache=caches[micro_step]).loss
            engine.backward(loss)
            # DeepSpeed steps the optimizer only at the accumulation boundary
            grad_norm = step_and_grad_norm(engine)
            losses.append(loss.item())
        step = run.end_step(all_reduce_mean([sum(losses) / len(losses)])[0])  # over every rank
        # A preemption signal or a non-finite step, as every rank sees it (the update of a
        # non-finite step is not applied).
        verdict = run.check(grad_norm)

        record = outer.maybe_outer_step(step, final=run.done) if outer else {}
        if run.due(args.logging_steps):
            record.update(run.train_metrics(grad_norm))
        if run.due(args.eval_steps) and not verdict.stop:  # a stop saves at once
            # eval_loss, eval_bpb (bits per byte of the text), per layer the fraction of x, y and
            # x*y above 0; nothing when a preemption signal comes during it
            record.update(evaluation_metrics(engine, data, signalled=run.signalled))
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
