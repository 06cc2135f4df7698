"""Pretrain BDH the way an accelerate user writes it: an Accelerator driving DeepSpeed (the same
ds_configs), accelerator.prepare, accelerator.backward, accelerator.save_state / load_state and
accelerate's trackers. The data, metrics, checkpoints' retention and export are the ZeRO
recipe's (recipes/pretrain.py), and so are its losses for the same arguments.

    accelerate launch --config_file launch/accelerate/zero2.yaml recipes/pretrain_accelerate.py \
        --output_dir runs/x
    accelerate launch --config_file launch/accelerate/zero3.yaml --num_processes 8 \
        recipes/pretrain_accelerate.py --bf16 --report_to tensorboard --output_dir runs/x

Top to bottom: the inputs (checked before any process group starts), the Accelerator, the model
and its optimizer prepared into a DeepSpeed engine, the run's state and its checkpointer, then the
loop: batch, forward, backward (which steps at the accumulation boundary), the LR schedule,
the DiLoCo outer step, logging, evaluation, save; then the export. Not here: --save_async
(recipes/pretrain.py).
"""

import os

import torch
from accelerate.utils import DummyOptim, DummyScheduler

from dragon.checkpoint.accelerator_state import AcceleratorCheckpointer
from dragon.checkpoint.card import write_run_files
from dragon.checkpoint.checkpointer import RNGState
from dragon.checkpoint.export import export_run, print_sample
from dragon.checkpoint.retention import attach_retention
from dragon.checkpoint.writes import SaveFailed
from dragon.history import metrics_path
from dragon.parallel.distributed import (all_reduce_mean, init_distributed,
                                         rank)
from dragon.diloco.build import outer_loop
from dragon.parallel.neurons import split_model
from dragon.parallel.topology import enter_island
from dragon.run.accelerator import (check_accelerate_inputs, make_accelerator,
                                    model_parallel_groups, tracked, tracker_config)
from dragon.run.data import run_data
from dragon.run.exits import end_process, run_recipe
from dragon.run.evaluation import evaluation_metrics
from dragon.run.faults import skip_nonfinite_updates
from dragon.run.inputs import initial_model
from dragon.run.lock import check_every_rank_sees
from dragon.run.loop import TrainingRun
from dragon.run.metrics import RECORDED_METRICS, setup_logging
from dragon.run.optim import planned_schedule
from dragon.run.preflight import preflight


def main():
    setup_logging()
    inputs = preflight()
    check_accelerate_inputs(inputs)
    args = inputs.train
    # With DiLoCo each island is a torch.distributed world of its own, entered before accelerate.
    topology = enter_island(inputs.diloco, args.dist_timeout)
    init_distributed(args.dist_timeout)  # gloo on CPU, nccl on CUDA; accelerate joins it
    run_dir = inputs.run_dir(topology.island)  # <output_dir>, or <output_dir>/island<i>
    check_every_rank_sees(run_dir)  # node-local disks would split the checkpoints: refused
    accelerator = make_accelerator(inputs, run_dir)
    model = initial_model(inputs)
    # --neuron_parallel K: each rank keeps N/K neurons of every head; data parallel over the rest
    neurons, dp_rank, dp_world = split_model(model, inputs.layout.neurons)
    # The JSON's optimizer (DeepSpeed builds it) and transformers' schedule, which DeepSpeed steps
    # at every applied update; a JSON's own "scheduler" wins.
    optimizer = DummyOptim(model.parameters())
    lr_schedule = planned_schedule(inputs.ds_config, args)
    scheduler = DummyScheduler(optimizer, lr_scheduler_callable=lr_schedule)
    with model_parallel_groups(neurons):  # DeepSpeed averages gradients within a share's ranks
        engine, _, _ = accelerator.prepare(model, optimizer, scheduler)  # DeepSpeed steps both
    skip_nonfinite_updates(engine)  # where DeepSpeed steps torch's optimizer as it is (ZeRO-0)
    save_dir = os.path.join(run_dir, "checkpoints")
    # every accelerator.save_state goes through engine.save_checkpoint: the completion marker
    # once every rank wrote its files, then the last --save_total_limit plus the best are kept
    attach_retention(engine, args.retention_policy(), RECORDED_METRICS, metrics_path(run_dir))
    outer = outer_loop(engine, inputs.diloco.config(), topology)  # None without DiLoCo

    # The run's state, every piece saved by every rank beside DeepSpeed's files.
    data_rank, data_world = topology.data_shard(dp_rank, dp_world)
    data = run_data(inputs, data_rank, data_world, dp_rank, dp_world, engine,
                    model.config.num_hidden_layers)
    shared, per_rank = data.checkpoint_pieces()
    torch.manual_seed(args.seed + topology.launch_rank)  # every rank its own dropout masks
    state = {**shared, **per_rank, "rng_state": RNGState(args.seed + topology.launch_rank)}
    if lr_schedule:  # the steps it was planned for: a resume keeps them
        state["lr_schedule"] = lr_schedule
    if outer:
        state["diloco_state"] = outer
    checkpointer = AcceleratorCheckpointer(accelerator, engine, save_dir, state)
    target = inputs.resume_target(topology.island)
    step = checkpointer.resume(target) if target else 0
    run = TrainingRun(engine, inputs, model.config, topology, data, dp_world, step, outer)
    if inputs.diloco.diloco_join:  # elastic: take the live islands' weights, outer state, step
        run.joined(*outer.join(), resumed=target is not None)
    if rank() == 0:
        write_run_files(save_dir, inputs, model.config, topology.islands, dp_world,
                        run.run_tokens_per_step)
    accelerator.init_trackers("dragon", config=tracker_config(args))

    train(accelerator, engine, run, data, outer, checkpointer, args)
    run.close()
    if outer:
        outer.close(ended_at=run.step)  # every island is past its last outer step, on theta_outer
    if topology.island == 0:  # with DiLoCo, island 0 exports for every island
        final_dir = export_run(engine, inputs, model.config, save_dir, run.step)
        if rank() == 0 and args.sample_max_new_tokens > 0:
            print_sample(final_dir, inputs.tokenizer, args.sample_prompt,
                         args.sample_max_new_tokens)
    accelerator.end_training()  # the trackers finish their files; the process group ends


def train(accelerator, engine, run, data, outer, checkpointer, args) -> None:
    """The loop: batch, forward, backward, step, outer step, logging, evaluation, save."""
    engine.train()
    while not run.done:
        losses = []
        caches = run.step_caches()  # with --carry_state each micro-batch's rows continue a state
        for micro_step in range(run.accum):
            batch = next(data.train).to(accelerator.device)
            # accumulate(): the last micro-batch of the step is the boundary, where
            # accelerator.backward steps DeepSpeed's optimizer and the LR schedule
            with accelerator.accumulate(engine):
                loss = engine(input_ids=batch, labels=batch, cache=caches[micro_step]).loss
                accelerator.backward(loss)
            losses.append(loss.item())
        grad_norm = engine.get_global_grad_norm()  # None where DeepSpeed records none (ZeRO-0)
        step = run.end_step(all_reduce_mean([sum(losses) / len(losses)])[0])  # over every rank
        # A preemption signal or a non-finite step, as every rank sees it.
        verdict = run.check(grad_norm)

        record = outer.maybe_outer_step(step, final=run.done) if outer else {}
        if run.due(args.logging_steps):
            record.update(run.train_metrics(grad_norm))
        if run.due(args.eval_steps) and not verdict.stop:  # a stop saves at once
            record.update(evaluation_metrics(engine, data, signalled=run.signalled))
        run.log(record)  # metrics.jsonl
        accelerator.log(tracked(record), step=step)
        if run.due(args.save_steps) or verdict.save:
            try:
                checkpointer.save(step)  # accelerator.save_state(<run>/checkpoints/checkpoint_N)
            except SaveFailed as failure:  # some rank could not write; the last save stands
                run.save_failed(failure)  # trains on with --save_failure continue, else stops
        if verdict.stop:
            run.stop(verdict)


if __name__ == "__main__":
    # an early end (a refusal, a preemption, a failure) exits with one line and its code
    end_process(run_recipe(main))
