"""The checkpoint side of a run's set-up (dragon.run.setup): retention around the engine's save,
the Checkpointer of the engine and the run's other state, the resume into a TrainingRun (and an
elastic island's join), and the run's files beside the checkpoints."""

from typing import Any, Optional

import torch

from dragon.checkpoint.accelerator_state import AcceleratorCheckpointer
from dragon.checkpoint.card import write_run_files
from dragon.checkpoint.checkpointer import Checkpointer, RNGState
from dragon.checkpoint.save_hook import attach_retention, is_directory_writer
from dragon.history import metrics_path
from dragon.parallel.topology import Topology
from dragon.run.data import RunData
from dragon.run.inputs import RecipeInputs
from dragon.run.loop import TrainingRun
from dragon.run.metrics import RECORDED_METRICS


def keep_checkpoints(engine: Any, inputs: RecipeInputs, island: int) -> None:
    """After every engine.save_checkpoint of island `island` (accelerator.save_state calls it
    too): a completion marker once every rank wrote its files, and pruning to the last
    --save_total_limit plus the best by --metric_for_best_model; with --checkpoint_copy_to, its
    copy to the store."""
    attach_retention(engine, inputs.train.retention_policy(), RECORDED_METRICS,
                     metrics_path(inputs.run_dir(island)), copy_to=inputs.copy_to(island))


def run_checkpointer(built, save_dir: str, data: RunData, outer: Optional[Any],
                     inputs: RecipeInputs, topology: Topology) -> Checkpointer:
    """The Checkpointer of the engine and the run's other state: the data position and tokens
    trained (the carried states, a stream's position), RNG, the LR schedule, DiLoCo's state.
    `built`: the recipe's dragon.run.setup.Built."""
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


def resumed_run(built, inputs: RecipeInputs, topology: Topology, data: RunData,
                outer: Optional[Any], checkpointer: Checkpointer, save_dir: str) -> TrainingRun:
    """The TrainingRun from --resume_from_checkpoint's step (0 without one), moved on to the live
    islands' step when this island joins them (--diloco_join); then the island's first rank
    (each node's, on node-local disks) writes the run's files beside the checkpoints."""
    target = checkpointer.agreed(inputs.resume_target(topology.island),
                                 inputs.train.resume_from_checkpoint)
    step = checkpointer.resume(target) if target else 0
    run = TrainingRun(built.engine, inputs, built.config, topology, data, built.dp_world, step,
                      outer)
    if inputs.diloco.diloco_join:  # elastic: take the live islands' weights, outer state, step
        run.joined(*outer.join(), resumed=target is not None)
    if is_directory_writer(built.engine):
        write_run_files(save_dir, inputs, built.config, topology.islands, built.dp_world,
                        run.run_tokens_per_step)
    return run
