"""Pretrain BDH the way an accelerate user writes it: an Accelerator driving DeepSpeed (the same
ds_configs), accelerator.prepare, accelerator.backward, accelerator.save_state / load_state and
accelerate's trackers. The data, metrics, checkpoints' retention and export are the ZeRO
recipe's (recipes/pretrain.py), and so are its losses for the same arguments.

    accelerate launch --config_file launch/accelerate/zero2.yaml recipes/pretrain_accelerate.py \
        --output_dir runs/x
    accelerate launch --config_file launch/accelerate/zero3.yaml --num_processes 8 \
        recipes/pretrain_accelerate.py --bf16 --report_to tensorboard --output_dir runs/x

Top to bottom: accelerate_engine, the recipe's own set-up (the Accelerator, then the model and
its optimizer prepared into a DeepSpeed engine); main(), which sets the run up around it
(dragon.run.setup: the inputs, checked before any process group starts, the run's state and its
checkpointer), starts accelerate's trackers, trains and exports; then the loop: batch, forward,
backward (accelerator.backward runs engine.backward, then engine.step() at the accumulation
boundary: the optimizer and the LR schedule), the DiLoCo outer step, logging, evaluation, save.
Not here: --save_async (recipes/pretrain.py).
"""

from accelerate.utils import DummyOptim, DummyScheduler

from dragon.checkpoint.writes import SaveFailed
from dragon.parallel.deepspeed_fixes import skip_compiling_unused_muon, skip_nonfinite_updates
from dragon.parallel.distributed import all_reduce_mean
from dragon.parallel.neurons import split_model
from dragon.run.accelerator import (check_accelerate_inputs, make_accelerator,
                                    model_parallel_groups, tracked, tracker_config)
from dragon.run.evaluation import evaluation_metrics
from dragon.run.exits import end_process, run_recipe
from dragon.run.inputs import RecipeInputs, initial_model
from dragon.run.metrics import global_grad_norm
from dragon.run.optim import parameter_groups, planned_schedule
from dragon.run.setup import Built, set_up, tear_down


def accelerate_engine(inputs: RecipeInputs, run_dir: str) -> Built:
    """An Accelerator driving DeepSpeed, and the model prepared by it into a DeepSpeed engine with
    the JSON's optimizer and transformers' schedule (a JSON's own "scheduler" wins: then
    Built.lr_schedule is None). Saves and resumes go through the Accelerator (save_state)."""
    accelerator = make_accelerator(inputs, run_dir)  # first, as accelerate users write it
    model = initial_model(inputs)
    # --neuron_parallel K: each rank keeps N/K neurons of every head; data parallel over the rest
    neurons, dp_rank, dp_world = split_model(model, inputs.layout.neurons)
    # The JSON's optimizer (DeepSpeed builds it) and transformers' schedule, which DeepSpeed steps
    # at every applied update; a JSON's own "scheduler" wins.
    # --lr_scales, and no weight decay for biases and norms
    optimizer = DummyOptim(parameter_groups(model, inputs.ds_config, inputs.train))
    lr_schedule = planned_schedule(inputs.ds_config, inputs.train)
    scheduler = DummyScheduler(optimizer, lr_scheduler_callable=lr_schedule)
    skip_compiling_unused_muon(inputs.ds_config)  # DeepSpeed imports its Muon in every ZeRO run
    with model_parallel_groups(neurons):  # DeepSpeed averages gradients within a share's ranks
        engine, _, _ = accelerator.prepare(model, optimizer, scheduler)  # DeepSpeed steps both
    skip_nonfinite_updates(engine)  # where DeepSpeed steps torch's optimizer as it is (ZeRO-0)
    return Built(engine, model.config, dp_rank, dp_world, model.config.num_hidden_layers,
                 lr_schedule, accelerator)


def main():
    # inputs (and this recipe's refusals), engine, data, checkpointer, resume
    setup = set_up(accelerate_engine, check=check_accelerate_inputs)
    accelerator = setup.accelerator
    accelerator.init_trackers("dragon", config=tracker_config(setup.args))
    train(accelerator, setup.engine, setup.run, setup.data, setup.outer, setup.checkpointer,
          setup.args, setup.profiler)
    tear_down(setup)  # the export to <output_dir>/final and a sample
    accelerator.end_training()  # the trackers finish their files; the process group ends


def train(accelerator, engine, run, data, outer, checkpointer, args, profiler) -> None:
    """The loop: batch, forward, backward, step, outer step, logging, evaluation, save, profiler."""
    engine.train()
    while not run.done:
        if outer and not outer.trains(run.step + 1):  # --diloco_island_steps: a slower island
            step, grad_norm = run.rest(), None  # rests through some steps of each window
        else:
            losses = []
            caches = run.step_caches()  # with --carry_state each micro-batch's rows go on
            for micro_step in range(run.accum):
                batch = next(data.train).to(accelerator.device)
                # accumulate(): the last micro-batch of the step is the boundary, where
                # accelerator.backward runs engine.backward, then engine.step() (DeepSpeed's
                # optimizer and the LR schedule); before it, engine.backward alone
                with accelerator.accumulate(engine):
                    loss = engine(input_ids=batch, labels=batch, cache=caches[micro_step]).loss
                    accelerator.backward(loss)
                losses.append(loss.item())
            grad_norm = global_grad_norm(engine)  # None where DeepSpeed has none (ZeRO-0, fp32)
            step = run.end_step(all_reduce_mean([sum(losses) / len(losses)])[0])  # every rank's
        # A preemption signal or a non-finite step, as every rank sees it.
        verdict = run.check(grad_norm)

        record = outer.maybe_outer_step(step, final=run.done) if outer else {}
        if outer and outer.joined_step > step:  # it landed late, in the live islands' next one
            step, grad_norm = run.catch_up(outer.joined_step, grad_norm), None
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
        profiler.step(step)  # --profile_steps A:B: traces steps A to B, then prints its table
        if verdict.stop:
            run.stop(verdict)


if __name__ == "__main__":
    # an early end (a refusal, a preemption, a failure) exits with one line and its code
    end_process(run_recipe(main))
