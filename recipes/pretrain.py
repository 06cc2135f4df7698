"""Pretrain BDH with DeepSpeed's ZeRO engine (stages 0-3, fp32 or bf16, optional CPU offload).

    torchrun --nproc_per_node 2 recipes/pretrain.py --deepspeed ds_configs/zero2.json \
        --output_dir runs/x
    deepspeed --num_gpus 8 recipes/pretrain.py --deepspeed ds_configs/zero3.json --bf16 \
        --output_dir runs/x
    accelerate launch --config_file launch/accelerate/zero2.yaml recipes/pretrain.py \
        --output_dir runs/x

Top to bottom: deepspeed_engine, the recipe's own set-up (the model in a DeepSpeed engine);
main(), which sets the run up around it (dragon.run.setup: the inputs, all checked before any
process group starts, the run's state and the Checkpointer that saves and resumes it), trains and
exports; then the loop: batch, forward, backward, engine.step(), the DiLoCo outer step, logging,
evaluation, save. An early end (a preemption, a failure) is an exception that run_recipe turns
into one line and an exit code.
"""

import deepspeed

from dragon.checkpoint.writes import SaveFailed
from dragon.parallel.deepspeed_fixes import skip_compiling_unused_muon, skip_nonfinite_updates
from dragon.parallel.distributed import all_reduce_mean
from dragon.parallel.neurons import split_model
from dragon.run.evaluation import evaluation_metrics
from dragon.run.exits import end_process, run_recipe
from dragon.run.inputs import RecipeInputs, initial_model
from dragon.run.metrics import global_grad_norm, grad_norm_before_step
from dragon.run.optim import client_optimizer_and_scheduler, parameter_groups
from dragon.run.setup import Built, set_up, tear_down


def deepspeed_engine(inputs: RecipeInputs, run_dir: str) -> Built:
    """The model in a DeepSpeed engine, with torch's AdamW and transformers' schedule unless the
    JSON names its own (then Built.lr_schedule is None)."""
    model = initial_model(inputs)
    # --neuron_parallel K: each rank keeps N/K neurons of every head; data parallel over the rest.
    # DeepSpeed reads the neuron groups as its model-parallel unit (mpu).
    neurons, dp_rank, dp_world = split_model(model, inputs.layout.neurons)
    # --lr_scales, and no weight decay for biases and norms
    groups = parameter_groups(model, inputs.ds_config, inputs.train)
    optimizer, lr_schedule = client_optimizer_and_scheduler(groups, inputs.ds_config, inputs.train)
    skip_compiling_unused_muon(inputs.ds_config)  # DeepSpeed imports its Muon in every ZeRO run
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=lr_schedule,
        model_parameters=groups,
        config=inputs.ds_config,
        mpu=neurons,
    )
    skip_nonfinite_updates(engine)  # where DeepSpeed steps torch's optimizer as it is (ZeRO-0)
    if inputs.train.torch_compile:
        engine.compile()
    return Built(engine, model.config, dp_rank, dp_world, model.config.num_hidden_layers,
                 lr_schedule)


def main():
    setup = set_up(deepspeed_engine)  # inputs, engine, data, Checkpointer, resume
    train(setup.engine, setup.run, setup.data, setup.outer, setup.checkpointer, setup.args,
          setup.profiler)
    tear_down(setup)  # the export to <output_dir>/final and a sample


def train(engine, run, data, outer, checkpointer, args, profiler) -> None:
    """The loop: batch, forward, backward, step, outer step, logging, evaluation, save, profiler."""
    engine.train()
    while not run.done:
        if outer and not outer.trains(run.step + 1):  # --diloco_island_steps: a slower island
            step, grad_norm = run.rest(), None  # rests through some steps of each window
        else:
            losses = []
            caches = run.step_caches()  # with --carry_state each micro-batch's rows go on
            for micro_step in range(run.accum):
                batch = next(data.train).to(engine.device)
                loss = engine(input_ids=batch, labels=batch, cache=caches[micro_step]).loss
                engine.backward(loss)
                measured = grad_norm_before_step(engine)  # ZeRO-0 in fp32: DeepSpeed has none
                engine.step()  # DeepSpeed steps the optimizer only at the accumulation boundary
                losses.append(loss.item())
            grad_norm = global_grad_norm(engine, measured)  # the step's, before clipping
            step = run.end_step(all_reduce_mean([sum(losses) / len(losses)])[0])  # every rank's
        # A preemption signal or a non-finite step, as every rank sees it (the update of a
        # non-finite step is not applied).
        verdict = run.check(grad_norm)

        record = outer.maybe_outer_step(step, final=run.done) if outer else {}
        if outer and outer.joined_step > step:  # it landed late, in the live islands' next one
            step, grad_norm = run.catch_up(outer.joined_step, grad_norm), None
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
        profiler.step(step)  # --profile_steps A:B: traces steps A to B, then prints its table
        if verdict.stop:
            run.stop(verdict)


if __name__ == "__main__":
    # an early end (a refusal, a preemption, a failure) exits with one line and its code
    end_process(run_recipe(main))
