"""What every recipe does before and after its loop: set_up() and tear_down().

set_up(build_engine) takes the recipe's own part, the function that turns the checked inputs into
a model and its engine (deepspeed.initialize, a PipelineModule's engine, accelerator.prepare),
and does the rest in this order: logging, preflight (every check before a process group starts),
the DiLoCo island, the process group, the run directory, the model and engine (build_engine),
checkpoint retention, the DiLoCo outer loop, this rank's data, the Checkpointer and its pieces,
the resume, the TrainingRun, an elastic island's join, the run's files beside the checkpoints
and the StepProfiler of --profile_steps. tear_down(setup) ends the run after the loop: the
progress bar, the outer loop, the export and a sample. The loop itself (batch, forward,
backward, engine.step(), outer step, logging, evaluation, save) stays in each recipe.
"""

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from dragon.checkpoint.accelerator_state import AcceleratorCheckpointer
from dragon.checkpoint.card import write_run_files
from dragon.checkpoint.checkpointer import Checkpointer, RNGState
from dragon.checkpoint.export import export_run, print_sample
from dragon.checkpoint.save_hook import attach_retention
from dragon.diloco.build import outer_loop
from dragon.history import metrics_path
from dragon.parallel.distributed import init_distributed, rank
from dragon.parallel.topology import Topology, enter_island
from dragon.run.args import TrainingArguments
from dragon.run.data import RunData, run_data
from dragon.run.inputs import RecipeInputs
from dragon.run.lock import check_every_rank_sees
from dragon.run.loop import TrainingRun
from dragon.run.metrics import RECORDED_METRICS, setup_logging
from dragon.run.preflight import preflight
from dragon.run.profiler import StepProfiler


@dataclass
class Built:
    """What a recipe's build function returns: its engine and what the run reads of it."""

    engine: Any  # a DeepSpeedEngine (a PipelineEngine in the pipeline recipe)
    config: Any  # the model's: a BDHConfig, or a baseline's (--model_type)
    dp_rank: int  # this rank among the data-parallel ranks of its island
    dp_world: int
    layers: int  # the layers this rank runs, whose attention states --carry_state keeps
    lr_schedule: Optional[Any] = None  # dragon's LRSchedule; None when the JSON names its own
    accelerator: Optional[Any] = None  # the accelerate recipe's: saves go through it


# (inputs, run directory) -> the model in its engine; the accelerate recipe makes its Accelerator
# from the run directory before the model, as accelerate users do.
BuildEngine = Callable[[RecipeInputs, str], Built]


@dataclass
class Setup:
    """What a recipe's loop and tear_down() need, as set_up() left it."""

    inputs: RecipeInputs
    topology: Topology
    engine: Any
    config: Any  # the model's
    data: RunData
    outer: Optional[Any]  # the DiLoCo outer loop (dragon.diloco.build); None without DiLoCo
    checkpointer: Checkpointer
    run: TrainingRun
    save_dir: str  # <run dir>/checkpoints
    profiler: StepProfiler  # --profile_steps: its step() ends each step of the loop
    accelerator: Optional[Any] = None  # the accelerate recipe's Accelerator

    @property
    def args(self) -> TrainingArguments:
        return self.inputs.train


def set_up(build_engine: BuildEngine, pipeline: bool = False,
           check: Optional[Callable[[RecipeInputs], None]] = None) -> Setup:
    """Everything before a recipe's loop (module docstring). `pipeline`: the pipeline recipe's
    inputs (PipelineArguments, its checks); `check`: the recipe's own refusals of the checked
    inputs, before any process group starts."""
    setup_logging()
    inputs = preflight(pipeline=pipeline)
    if check is not None:
        check(inputs)
    args = inputs.train
    # With DiLoCo each island is a torch.distributed world of its own, entered before DeepSpeed.
    topology = enter_island(inputs.diloco, args.dist_timeout)
    init_distributed(args.dist_timeout)  # gloo on CPU, nccl on CUDA; accelerate joins it
    run_dir = inputs.run_dir(topology.island)  # <output_dir>, or <output_dir>/island<i>
    check_every_rank_sees(run_dir)  # node-local disks would split the checkpoints: refused
    built = build_engine(inputs, run_dir)
    engine, save_dir = built.engine, os.path.join(run_dir, "checkpoints")
    # Optional: after every engine.save_checkpoint (accelerator.save_state calls it too), a
    # completion marker once every rank wrote its files, and pruning to the last
    # --save_total_limit plus the best by --metric_for_best_model.
    attach_retention(engine, args.retention_policy(), RECORDED_METRICS, metrics_path(run_dir))
    outer = outer_loop(engine, inputs.diloco.config(), topology)  # None without DiLoCo
    data_rank, data_world = topology.data_shard(built.dp_rank, built.dp_world)
    # this rank's data, and the attention states of its layers that --carry_state keeps
    data = run_data(inputs, data_rank, data_world, built.dp_rank, built.dp_world, engine,
                    built.layers)
    checkpointer = _checkpointer(built, save_dir, data, outer, inputs, topology)
    run = _resumed_run(built, inputs, topology, data, outer, checkpointer)
    if rank() == 0:
        write_run_files(save_dir, inputs, built.config, topology.islands, built.dp_world,
                        run.run_tokens_per_step)
    profiler = StepProfiler(args.profile_steps, run_dir, rank(), args.max_steps, run.step)
    return Setup(inputs, topology, engine, built.config, data, outer, checkpointer, run,
                 save_dir, profiler, built.accelerator)


def _checkpointer(built: Built, save_dir: str, data: RunData, outer, inputs: RecipeInputs,
                  topology: Topology) -> Checkpointer:
    """The Checkpointer of the engine and the run's other state: the data position and tokens
    trained (the carried states, a stream's position), RNG, the LR schedule, DiLoCo's state."""
    shared, per_rank = data.checkpoint_pieces()
    if built.lr_schedule:  # the steps it was planned for: a resume keeps them
        shared["lr_schedule"] = built.lr_schedule
    seed = inputs.train.seed + topology.launch_rank
    torch.manual_seed(seed)  # every rank its own dropout masks
    per_rank["rng_state"] = RNGState(seed)
    if outer:
        per_rank["diloco_state"] = outer
    if built.accelerator is not None:  # accelerator.save_state: every rank saves every piece
        return AcceleratorCheckpointer(built.accelerator, built.engine, save_dir,
                                       {**shared, **per_rank})
    return Checkpointer(built.engine, save_dir, shared, per_rank, inputs.train.save_async)


def _resumed_run(built: Built, inputs: RecipeInputs, topology: Topology, data: RunData, outer,
                 checkpointer: Checkpointer) -> TrainingRun:
    """The TrainingRun from --resume_from_checkpoint's step (0 without one), moved on to the live
    islands' step when this island joins them (--diloco_join)."""
    target = inputs.resume_target(topology.island)
    step = checkpointer.resume(target) if target else 0
    run = TrainingRun(built.engine, inputs, built.config, topology, data, built.dp_world, step,
                      outer)
    if inputs.diloco.diloco_join:  # elastic: take the live islands' weights, outer state, step
        run.joined(*outer.join(), resumed=target is not None)
    return run


def tear_down(setup: Setup) -> None:
    """After the loop: the progress bar ends its line, the outer loop closes, island 0 exports
    <output_dir>/final (for every island) and rank 0 prints a sample of it."""
    run, outer, args = setup.run, setup.outer, setup.args
    run.close()
    if outer:
        outer.close(ended_at=run.step)  # every island is past its last outer step, on theta_outer
    if setup.topology.island == 0:  # with DiLoCo, island 0 exports for every island
        final_dir = export_run(setup.engine, setup.inputs, setup.config, setup.save_dir, run.step)
        if rank() == 0 and args.sample_max_new_tokens > 0:
            print_sample(final_dir, setup.inputs.tokenizer, args.sample_prompt,
                         args.sample_max_new_tokens)
