"""Resume a checkpoint on another data-parallel size, ZeRO stage or recipe, exactly.

A checkpoint saved on one layout is converted once into its universal form
(dragon.checkpoint.universal:
one file per parameter and state, fp32 weights, Adam's two moments, the step), in the resuming
run's checkpoints/ as <tag>_universal/ (the source is only read); an engine whose config has
"checkpoint": {"load_universal": true} loads that
into its own partitioning, and a ZeRO-0 launch loads a ZeRO-0 checkpoint made from it
(<tag>_zero0/). The LR schedule and the client state (step, data position) travel in the model
states file. dragon's data position is global (the step), so with the same global batch the
resumed run reads the batches the uninterrupted run would have. Per-rank RNG streams cannot
follow a change of rank count: each rank takes the saved stream of its own rank number where
one exists; the others restore none, so their dropout masks differ from the uninterrupted run's.

A run of DiLoCo islands resumes by another number of islands (saved_islands, regroup_message):
each island that was saved continues from its own checkpoint and a new one from island 0's. An
island resumed on another layout reads its outer state (theta_outer, the outer optimizer's
moments, the average in flight), saved by parameter name, for its new partition from every saved
rank's (dragon.diloco.state.joined_state).

A ZeRO-0 checkpoint on another number of ranks loads as it is (one file). A ZeRO-0 pipeline
checkpoint becomes a plain model's ZeRO-0 checkpoint and back (dragon.checkpoint.pipeline_files),
so the recipes resume each other's checkpoints and a pipeline resumes on other stage boundaries,
with its neuron shares' files cut from the whole model for a pipeline of K shares; a ZeRO-1 pipeline
loads the same pipeline form through the universal folder beside it, as a bf16 pipeline does
(DeepSpeed's bf16 optimizer keeps its fp32 masters in files of its own, per stage, under ZeRO-0
too). A bf16 ZeRO-0 checkpoint carries its fp32 masters into the universal form and out of it.
"""

import glob
import json
import logging
import os
import shutil
from typing import Optional

import torch

from dragon.checkpoint import universal
from dragon.model.bdh import BDHConfig
from dragon.checkpoint.pipeline_files import (pipeline_universal, stage_files, write_pipeline,
                                        zero0_states_of_pipeline)
from dragon.checkpoint.retention import CONVERSIONS
from dragon.checkpoint.neuron_shares import (neuron_shares, share_states, universal_from_shares,
                                             write_zero0_shares)
from dragon.parallel.layout import Layout
from dragon.parallel.pipeline import pipeline_neuron_shares

logger = logging.getLogger("dragon")
UNIVERSAL, ZERO0, PIPELINE = CONVERSIONS  # retention deletes them with their checkpoint
SOURCE_FILE = "dragon_converted_from.txt"  # in a conversion: the checkpoint it was made from


def saved_layout(load_dir: str, tag: str) -> Layout:
    """The layout a checkpoint was saved with (its model states file records it)."""
    tag_dir = os.path.join(load_dir, tag)
    try:
        path = universal.model_states_file(tag_dir)
    except ValueError:
        raise ValueError(f"--resume_from_checkpoint: {tag_dir} holds no DeepSpeed model states")
    state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    config = state["ds_config"]
    stage = int(config.get("zero_optimization", {}).get("stage", 0))
    pipeline = bool(glob.glob(os.path.join(tag_dir, "layer_*-model_states.pt")))
    batch = int(config.get("train_batch_size", 0))
    bf16 = bool(config.get("bf16", {}).get("enabled", False))
    # a pipeline's engine counts its stages (x its neuron shares) as model-parallel ranks
    neurons = pipeline_neuron_shares(tag_dir) if pipeline else int(state.get("mp_world_size") or 1)
    stages = len(stage_files(tag_dir)) // neurons if pipeline else 1
    return Layout(stages=stages, neurons=neurons, data_parallel=int(state["dp_world_size"]),
                  zero_stage=stage, pipeline=pipeline, bf16=bf16, global_batch=batch)


def reshape_message(saved: Layout, launch: Layout) -> Optional[str]:
    """None when the checkpoint loads as it is; else the one line a conversion prints."""
    if saved == launch or (saved.zero_stage == launch.zero_stage == 0 and not saved.pipeline
                           and not launch.pipeline and saved.neurons == launch.neurons
                           and saved.bf16 == launch.bf16):
        return None  # ZeRO-0: one file (per share) with everything, loaded on any number of ranks
    ranks = lambda x: x.data_parallel * x.stages  # noqa: E731
    rng = ("" if ranks(saved) == ranks(launch) else
           f"; RNG streams only for ranks below {min(ranks(saved), ranks(launch))} (dropout "
           "masks of the others differ)")
    return (
        f"resume: converting the checkpoint from {saved} to {launch} (a universal checkpoint); "
        f"weights, Adam moments and step, LR schedule and data position are kept{rng}"
    )


def convert(load_dir: str, tag: str, form: str, parts: Optional[list[int]] = None,
            bf16: bool = False, neurons: int = 1, out_dir: Optional[str] = None
            ) -> tuple[str, str]:
    """(folder, tag) of checkpoint `tag` in the `form` a launch loads: "universal" (ZeRO-1/2/3),
    or "zero0" (fp32 or `bf16`, of `neurons` shares) or "pipeline" (of stage boundaries `parts`)
    made from that. A form already beside the checkpoint (recipes/reshape_checkpoint.py) is
    used as it is; anything to write goes to `out_dir` (default: beside the checkpoint), so a
    resume never writes into another run's directory. Each is written once, atomically; a
    ZeRO-0 form of another precision or share count, or a pipeline of other boundaries, is
    written again."""
    out_dir = out_dir or load_dir
    tag_dir = os.path.join(load_dir, tag)
    target = _made(tag_dir, out_dir, tag + UNIVERSAL, lambda folder: True)
    if not os.path.isdir(target):
        saved = saved_layout(load_dir, tag)
        if saved.neurons > 1 or (saved.pipeline and (saved.zero_stage > 0 or saved.bf16)):
            # the shares and stages (their optimizer's files) joined into the whole model
            config = BDHConfig.from_pretrained(load_dir)
            make = lambda out: universal_from_shares(tag_dir, out, config,  # noqa: E731
                                                     saved.stages)
        elif saved.pipeline:
            make = lambda out: universal.from_zero0_states(  # noqa: E731
                zero0_states_of_pipeline(tag_dir), out, tag_dir)
        elif saved.zero_stage == 0:
            make = lambda out: universal.from_zero0(tag_dir, out)  # noqa: E731
        else:
            make = lambda out: universal.from_deepspeed(tag_dir, out)  # noqa: E731
        os.makedirs(out_dir, exist_ok=True)
        _write(make, target, tag_dir)
    if form == "universal":
        return os.path.dirname(target), tag + UNIVERSAL
    if form == "zero0":
        zero0 = _made(tag_dir, out_dir, tag + ZERO0,
                      lambda folder: _zero0_form(folder) == (bf16, neurons))
        if not os.path.isdir(zero0):
            config = BDHConfig.from_pretrained(load_dir) if neurons > 1 else None
            make = (lambda out: write_zero0_shares(target, out, config, neurons, bf16)) \
                if neurons > 1 else (lambda out: universal.to_zero0(target, out, bf16))
            _write(make, zero0, tag_dir)
        return os.path.dirname(zero0), tag + ZERO0

    def same_stages(folder: str) -> bool:
        shape = os.path.join(folder, "parts.json")
        return os.path.isfile(shape) and _read_json(shape) == {"parts": parts, "neurons": neurons}

    pipe = _made(tag_dir, out_dir, tag + PIPELINE, same_stages)
    if not os.path.isdir(pipe):
        config = BDHConfig.from_pretrained(load_dir)

        def make(out: str) -> None:
            whole = universal.zero0_states(target)
            for j in range(neurons):
                states = share_states(whole, config, j, neurons) if neurons > 1 else whole
                write_pipeline(states, config, parts, out, (j, neurons))
            pipeline_universal(target, config, out)
            with open(os.path.join(out, "parts.json"), "w") as f:
                json.dump({"parts": parts, "neurons": neurons}, f)

        _write(make, pipe, tag_dir)
    return os.path.dirname(pipe), tag + PIPELINE


def _made(tag_dir: str, out_dir: str, name: str, fits) -> str:
    """The folder `name` that serves: beside the checkpoint, or in `out_dir` when made from this
    very checkpoint, where it exists and `fits`; else the path in `out_dir` to write it to (one
    there that does not serve is removed)."""
    beside = os.path.join(os.path.dirname(tag_dir), name)
    mine = os.path.join(out_dir, name)
    if os.path.isdir(beside) and fits(beside):
        return beside
    if mine != beside and os.path.isdir(mine) and _source_of(mine) == os.path.abspath(tag_dir) \
            and fits(mine):
        return mine
    shutil.rmtree(mine, ignore_errors=True)
    return mine


def _write(make, folder: str, tag_dir: str) -> None:
    """make(folder) atomically, with the checkpoint it was made from recorded in it."""
    def make_and_record(out: str) -> None:
        make(out)
        with open(os.path.join(out, SOURCE_FILE), "w") as f:
            f.write(os.path.abspath(tag_dir))

    universal.write_atomically(make_and_record, folder)


def _source_of(folder: str) -> str:
    path = os.path.join(folder, SOURCE_FILE)
    if not os.path.isfile(path):
        return ""
    with open(path) as f:
        return f.read()


def _zero0_form(folder: str) -> tuple[bool, int]:
    """(bf16, neuron shares) of a ZeRO-0 form written by convert()."""
    states = torch.load(os.path.join(folder, universal.STATES), map_location="cpu",
                        weights_only=False, mmap=True)
    return universal.is_bf16_zero0(states), len(neuron_shares(folder))


def _read_json(path: str):
    with open(path) as f:
        return json.load(f)


def converted_tag(load_dir: str, tag: str, form: str, parts: Optional[list[int]] = None,
                  bf16: bool = False, neurons: int = 1, out_dir: Optional[str] = None
                  ) -> tuple[str, str]:
    """convert() on global rank 0 while the others wait; every rank gets its (folder, tag)."""
    import torch.distributed as dist

    found = [None]
    if dist.get_rank() == 0:
        found = [convert(load_dir, tag, form, parts, bf16, neurons, out_dir)]
    dist.broadcast_object_list(found, src=0)
    return found[0]


def saved_islands(root: str) -> int:
    """The DiLoCo islands a run under `root` saved checkpoints for (1: a run without islands)."""
    count = 0
    while os.path.isdir(os.path.join(root, f"island{count}", "checkpoints")):
        count += 1
    return count or 1


def regroup_message(saved: Optional[int], launch: int, island: int, new: bool) -> str:
    """The line island `island` prints when a run saved by `saved` islands (None: not known
    here) resumes by `launch`; a `new` island starts from island 0's checkpoint."""
    origin = ("island 0's checkpoint (theta_outer, the outer optimizer's state and the step; its "
              "own RNG streams)" if new else "its own checkpoint")
    left = f"; islands {list(range(launch, saved))} are left out" if (saved or 0) > launch else ""
    by = f"was saved by {saved} island(s) and " if saved else ""
    return (f"resume: the run {by}resumes by {launch}: island {island} continues from "
            f"{origin}{left}; the data is shared out among {launch} island(s) from this step "
            "on, so its order differs from the uninterrupted run's")
