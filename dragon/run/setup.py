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
from typing import TYPE_CHECKING, Any, Callable, Optional

from dragon.checkpoint.export import export_run, print_sample
from dragon.diloco.build import outer_loop
from dragon.parallel.distributed import init_distributed, rank
from dragon.parallel.topology import Topology, enter_island
from dragon.run.checkpointing import keep_checkpoints, resumed_run, run_checkpointer
from dragon.run.data import RunData, run_data
from dragon.run.lock import check_every_rank_sees
from dragon.run.metrics import setup_logging, tokens_per_step
from dragon.run.preflight import preflight
from dragon.run.profiler import StepProfiler

if TYPE_CHECKING:  # annotations only
    from dragon.run.inputs import RecipeInputs


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
BuildEngine = Callable[["RecipeInputs", str], Built]


@dataclass
class Setup:
    """What a recipe's loop and tear_down() need, as set_up() left it."""

    inputs: "RecipeInputs"
    topology: Topology
    engine: Any
    config: Any  # the model's
    data: RunData
    outer: Optional[Any]  # the DiLoCo outer loop (dragon.diloco.build); None without DiLoCo
    checkpointer: Any  # a dragon.checkpoint.checkpointer.Checkpointer
    run: Any  # the dragon.run.loop.TrainingRun
    save_dir: str  # <run dir>/checkpoints
    profiler: StepProfiler  # --profile_steps: its step() ends each step of the loop
    accelerator: Optional[Any] = None  # the accelerate recipe's Accelerator

    @property
    def args(self) -> Any:
        """The run's TrainingArguments."""
        return self.inputs.train


def set_up(build_engine: BuildEngine, pipeline: bool = False,
           check: Optional[Callable[["RecipeInputs"], None]] = None) -> Setup:
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
    check_every_rank_sees(run_dir, node_local=args.checkpoint_storage == "local")
    built = build_engine(inputs, run_dir)
    engine, save_dir = built.engine, os.path.join(run_dir, "checkpoints")
    keep_checkpoints(engine, inputs, topology.island)  # retention around engine.save_checkpoint
    outer = outer_loop(engine, inputs.diloco.config(), topology,  # None without DiLoCo
                       tokens_per_step(engine, built.dp_world, inputs.data.block_size))
    data_rank, data_world = topology.data_shard(built.dp_rank, built.dp_world)
    # this rank's data, and the attention states of its layers that --carry_state keeps
    data = run_data(inputs, data_rank, data_world, built.dp_rank, built.dp_world, engine,
                    built.layers)
    checkpointer = run_checkpointer(built, save_dir, data, outer, inputs, topology)
    run = resumed_run(built, inputs, topology, data, outer, checkpointer, save_dir)
    profiler = StepProfiler(args.profile_steps, run_dir, rank(), args.max_steps, run.step)
    return Setup(inputs, topology, engine, built.config, data, outer, checkpointer, run,
                 save_dir, profiler, built.accelerator)


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
