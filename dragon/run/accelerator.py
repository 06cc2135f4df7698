"""The accelerate recipe's own set-up: what it refuses, and its Accelerator with DeepSpeed on
dragon's checked config and accelerate's trackers."""

import functools
import os
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from dragon.checkpoint.accelerator_state import MODEL_TAG
from dragon.errors import InputRefused
from dragon.parallel.ds_config import TRACKERS, trackers

# --report_to name -> accelerate's tracker (`Accelerator(log_with=...)`)
ACCELERATE_TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}


def check_accelerate_inputs(inputs) -> None:
    """InputRefused, in one line, for what the ZeRO recipe has and this one has not (inputs:
    dragon.run.inputs.RecipeInputs)."""
    args, target = inputs.train, inputs.resume_target(0)
    refused = [
        ("optimizer" not in inputs.ds_config,
         f"--deepspeed {args.deepspeed}: it names no optimizer (every file in ds_configs/ does)"),
        (args.save_async, "--save_async or the JSON's checkpoint.writer.decoupled (accelerate's "
         "save_state writes before it returns; recipes/pretrain_pipeline.py takes it too)"),
        ("csv" in trackers(args.report_to),
         "--report_to csv (accelerate has no csv tracker; metrics.jsonl holds every line)"),
        (target is not None and target.tag != MODEL_TAG,
         f"--resume_from_checkpoint {args.resume_from_checkpoint}: {target and target.tag} is "
         "not an accelerate save (this recipe resumes its own checkpoint_<step>)"),
        (target is not None and bool(target.reshaped),
         f"a resume on another layout ({target and target.reshaped})"),
        (args.checkpoint_storage == "local", "--checkpoint_storage local (save_state writes "
         "every node's files into one directory)"),
        (bool(args.checkpoint_copy_to), "--checkpoint_copy_to (its checkpoint_<step> layout is "
         "not copied)"),
    ]
    for refuse, what in refused:
        if refuse:
            raise InputRefused(f"recipes/pretrain_accelerate.py: not with {what}; "
                               "recipes/pretrain.py takes it")


def make_accelerator(inputs, run_dir: str):
    """An Accelerator driving DeepSpeed with the config preflight checked (every "auto" filled),
    reporting to the --report_to trackers through accelerate (not DeepSpeed's monitor)."""
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration

    monitors = {section for section, _, _ in TRACKERS.values()}
    ds_config = {k: v for k, v in inputs.ds_config.items() if k not in monitors}
    # The process group exists already (dragon.parallel.distributed.init_distributed); naming
    # its backend makes accelerate read its ranks (on a CPU it assumes one process otherwise).
    group = InitProcessGroupKwargs(backend=dist.get_backend(),
                                   timeout=timedelta(seconds=inputs.train.dist_timeout))
    return Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config),
        log_with=[ACCELERATE_TRACKERS[n] for n in trackers(inputs.train.report_to)] or None,
        project_config=ProjectConfiguration(project_dir=run_dir,
                                            logging_dir=os.path.join(run_dir, "monitor")),
        kwargs_handlers=[group],
    )


@contextmanager
def model_parallel_groups(mpu):
    """While accelerator.prepare runs, deepspeed.initialize also takes `mpu` (--neuron_parallel's
    groups): accelerate passes DeepSpeed an mpu only for its own sequence parallelism, and
    without one DeepSpeed would average gradients over ranks that hold different neurons."""
    import deepspeed

    initialize = deepspeed.initialize
    if mpu is not None:
        deepspeed.initialize = functools.partial(initialize, mpu=mpu)
    try:
        yield
    finally:
        deepspeed.initialize = initialize


def tracker_config(args) -> dict:
    """The run's arguments as trackers store them (numbers, strings, booleans)."""
    return {k: v for k, v in vars(args).items() if isinstance(v, (bool, int, float, str))}


def tracked(record: dict) -> dict:
    """A metrics line as accelerate's trackers take it: its numbers."""
    return {k: v for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}
