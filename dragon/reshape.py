"""Resume a ZeRO checkpoint on another data-parallel size, or between ZeRO-1 and ZeRO-2, exactly.

DeepSpeed's universal checkpoint converts: ds_to_universal writes one file per parameter and
state (fp32 weights, Adam's two moments, the step) next to the checkpoint, in <tag>_universal/,
and an engine whose config has "checkpoint": {"load_universal": true} loads them into its own
partitioning. The LR schedule and the client state (step, data position) travel in the model
states file. dragon's data position is global (the step), so with the same global batch the
resumed run reads the batches the uninterrupted run would have. Per-rank RNG streams cannot
follow a change of rank count: each rank takes the saved stream of its own rank number where
one exists; the others restore none, so their dropout masks differ from the uninterrupted run's.

ZeRO-0 checkpoints hold the whole model and optimizer in one file, which DeepSpeed already loads
on any number of ranks. ZeRO-3's universal files have another layout than ZeRO-1/2's (flat, no
shapes, no step file), so DeepSpeed converts within {ZeRO-1, ZeRO-2} and within ZeRO-3 only; a
change across those, between ZeRO-0 and the others, or of a pipeline is refused in one line.
"""

import argparse
import glob
import logging
import os
import shutil
from dataclasses import dataclass, field
from typing import Optional

import torch

logger = logging.getLogger("dragon")
UNIVERSAL = "_universal"


@dataclass(frozen=True)
class Layout:
    zero_stage: int
    data_parallel: int
    pipeline: bool = False
    global_batch: int = field(default=0, compare=False)  # samples per step

    def __str__(self) -> str:
        kind = "pipeline " if self.pipeline else ""
        return f"{kind}ZeRO-{self.zero_stage} on {self.data_parallel} data-parallel rank(s)"


def saved_layout(load_dir: str, tag: str) -> Layout:
    """The layout a checkpoint was saved with (its model states file records it)."""
    tag_dir = os.path.join(load_dir, tag)
    files = sorted(glob.glob(os.path.join(tag_dir, "*mp_rank_00_model_states.pt")))
    if not files:
        raise ValueError(f"--resume_from_checkpoint: {tag_dir} holds no DeepSpeed model states")
    state = torch.load(files[0], map_location="cpu", weights_only=False, mmap=True)
    stage = int(state["ds_config"].get("zero_optimization", {}).get("stage", 0))
    pipeline = bool(glob.glob(os.path.join(tag_dir, "layer_*-model_states.pt")))
    batch = int(state["ds_config"].get("train_batch_size", 0))
    return Layout(stage, int(state["dp_world_size"]), pipeline, batch)


def reshape_message(saved: Layout, launch: Layout) -> Optional[str]:
    """None when the checkpoint loads as it is; the one line a conversion prints; ValueError for
    a pair not converted."""
    if saved == launch or (saved.zero_stage == launch.zero_stage == 0
                           and saved.pipeline == launch.pipeline):
        return None  # ZeRO-0: one file with everything, loaded on any number of ranks
    family = lambda layout: 3 if layout.zero_stage == 3 else layout.zero_stage > 0  # noqa: E731
    if saved.pipeline or launch.pipeline or 0 in (saved.zero_stage, launch.zero_stage) or (
        family(saved) != family(launch)
    ):
        raise ValueError(
            f"--resume_from_checkpoint: the checkpoint was saved as {saved} and this launch is "
            f"{launch}; resuming across that change is not supported yet (ZeRO-1 and 2 on any "
            "number of ranks, and ZeRO-3 on any number of ranks, are)"
        )
    return (
        f"resume: converting the checkpoint from {saved} to {launch} (DeepSpeed's universal "
        "checkpoint); weights, Adam moments and step, LR schedule and data position are kept"
    )


def universal_tag(load_dir: str, tag: str) -> str:
    """Convert checkpoint `tag` once (global rank 0; the others wait) and return the tag of
    its universal form. The conversion is written to a temporary directory and renamed, so a
    crash never leaves a half-converted one behind."""
    import torch.distributed as dist

    target = os.path.join(load_dir, tag + UNIVERSAL)
    if dist.get_rank() == 0 and not os.path.isdir(target):
        from deepspeed.checkpoint import ds_to_universal

        partial = target + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        ds_to_universal.main(
            argparse.Namespace(
                input_folder=os.path.join(load_dir, tag),
                output_folder=partial,
                num_extract_workers=1,
                num_merge_workers=1,
                keep_temp_folder=False,
                strict=True,
                inject_missing_state=True,  # a plain data-parallel model needs nothing more
            )
        )
        os.replace(partial, target)
    dist.barrier()
    return tag + UNIVERSAL

