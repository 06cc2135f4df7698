"""Everything a recipe checks before any process group starts: the arguments, the DeepSpeed JSON,
the data, the model's sizes and attention form, the pipeline's shape and the resume target. A bad
input exits with one line naming it; what was built for the checks is returned for the run."""

import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from transformers import HfArgumentParser

from dragon.errors import InputRefused, PlanShown
from dragon.run.args import DiLoCoArguments, ModelArguments, PipelineArguments, TrainingArguments
from dragon.checkpoint.checkpointer import ResumeTarget, resolve_resume
from dragon.checkpoint.retention import list_checkpoints
from dragon.data.batches import TrainBatches, eval_batches
from dragon.run.carry import check_state_fits
from dragon.data.text import DataArguments, build_datasets
from dragon.data.streaming import build_streams, check_stream

from dragon.parallel.distributed import launcher_world_size
from dragon.parallel.ds_config import load_ds_config, resolve_ds_config, zero_stage
from dragon.model.bdh import BDHConfig, BDHForCausalLM
from dragon.run.memory import mark_baseline
from dragon.run.plan import plan_lines
from dragon.diloco.relayout import check_diloco_state
from dragon.checkpoint.reshape import (Layout, regroup_message, reshape_message,
                            saved_islands, saved_layout)
from dragon.parallel.topology import pipeline_data_parallel


@dataclass
class RecipeInputs:
    """The checked inputs of a run, and what was built to check them."""

    model: ModelArguments
    data: DataArguments
    train: TrainingArguments
    diloco: DiLoCoArguments  # DiLoCoArguments() when DiLoCo is off
    pipeline: Optional[PipelineArguments]  # None in the ZeRO recipe
    ds_config: dict  # every "auto" filled
    train_set: Any
    valid_set: Any
    tokenizer: Any
    resume: dict[int, tuple[str, str]]  # island -> (load_dir, tag) of --resume_from_checkpoint
    reshaped: dict[int, str] = field(default_factory=dict)  # island -> what the resume converts
    # island -> (the line of a resume by another number of islands, whether it is a new island)
    regrouped: dict[int, tuple[str, bool]] = field(default_factory=dict)

    def resume_target(self, island: int) -> Optional[ResumeTarget]:
        """What island `island` resumes from (--resume_from_checkpoint), or None."""
        if island not in self.resume:
            return None
        regrouped, new_island = self.regrouped.get(island, (None, False))
        return ResumeTarget(*self.resume[island], reshaped=self.reshaped.get(island),
                            regrouped=regrouped, new_island=new_island)

    def run_dir(self, island: int) -> str:
        """Where island `island` writes metrics.jsonl and checkpoints/ (<output_dir> without
        DiLoCo).
        """
        return self.diloco.output_dir(self.train.output_dir, island)


def preflight(pipeline: bool = False) -> RecipeInputs:
    """Parse the recipe's arguments (PipelineArguments too for the pipeline recipe), check them."""
    if pipeline and os.environ.get("ACCELERATE_USE_DEEPSPEED"):
        raise InputRefused(
            "accelerate does not drive DeepSpeed's pipeline engine; launch with "
            "`deepspeed --num_gpus N recipes/pretrain_pipeline.py --pipeline_stages P ...` instead"
        )
    types = (ModelArguments, DataArguments, TrainingArguments, DiLoCoArguments)
    parser = HfArgumentParser(types + ((PipelineArguments,) if pipeline else ()))
    try:
        model_args, data_args, args, diloco, *rest = parser.parse_args_into_dataclasses()
        pipe_args = rest[0] if pipeline else None
        dp_world, islands = _data_parallel_world(args, diloco, pipe_args)
        _, raw_config = load_ds_config(args.deepspeed)
        ds_config = resolve_ds_config(raw_config, args, dp_world)
        if pipeline and zero_stage(ds_config) > 1:
            raise ValueError(
                f"--deepspeed {args.deepspeed}: ZeRO stage {zero_stage(ds_config)} cannot shard a "
                "pipeline's gradients; use stage 0 or 1 (ds_configs/pipeline_zero*.json)"
            )
        _check_streaming(data_args, args)
        if data_args.streaming:
            train_set, valid_set, tokenizer = build_streams(data_args, args.seed)
        else:
            train_set, valid_set, tokenizer = build_datasets(data_args)
        _check_model(model_args, tokenizer.vocab_size, pipe_args)
        # Both raise when the data cannot fill one step / one evaluation on every rank.
        micro, accum = (
            ds_config["train_micro_batch_size_per_gpu"],
            ds_config["gradient_accumulation_steps"],
        )
        if data_args.streaming:
            check_stream(train_set, micro * accum * dp_world * islands, data_args.block_size)
        else:
            TrainBatches(train_set, micro, 0, dp_world * islands, accum)
        # (the validation streams of eval_loss_carried need exactly what these batches need)
        eval_batches(valid_set, args.per_device_eval_batch_size, 0, dp_world, args.max_eval_samples)
        if args.carry_state:
            rows = micro * accum + (args.per_device_eval_batch_size if args.eval_carried else 0)
            _check_carry(model_args, tokenizer.vocab_size, pipe_args, rows)
        resume, regrouped = _resume_targets(args, diloco)
        _check_output_dir(args, diloco)
        _check_resume_sizes(model_args, tokenizer.vocab_size, resume)
        stages = pipe_args.pipeline_stages if pipeline else 0
        reshaped = _check_reshape(resume, ds_config, dp_world, stages, diloco)
        config = _model_config(model_args, tokenizer.vocab_size)
    except ValueError as e:  # DataError and config errors are ValueErrors with one-line messages
        raise InputRefused(str(e)) from None
    if pipeline:
        _warn_about_the_bubble(ds_config["gradient_accumulation_steps"], pipe_args.pipeline_stages)
    inputs = RecipeInputs(
        model_args, data_args, args, diloco, pipe_args, ds_config, train_set, valid_set,
        tokenizer, resume, reshaped, regrouped,
    )
    if args.dry_run:
        print("\n".join(plan_lines(inputs, config, dp_world)))
        raise PlanShown("--dry_run: the plan above; nothing was trained")
    mark_baseline()  # memory_peak_mib counts from here: the model, engine and training
    return inputs


def _data_parallel_world(
    args: TrainingArguments, diloco: DiLoCoArguments, pipe_args: Optional[PipelineArguments]
) -> tuple[int, int]:
    """(data-parallel ranks of one island, islands) for this launch."""
    world, islands = launcher_world_size(), 1
    if diloco.enabled:  # every island is a world of its own; data is split over all of them
        diloco.check_training(args)
        world, islands = diloco.island_world(world), diloco.diloco_islands
    if pipe_args is None:
        return world, islands
    return pipeline_data_parallel(world, pipe_args.pipeline_stages, islands), islands


def _check_streaming(data_args: DataArguments, args: TrainingArguments) -> None:
    """Raise on what --streaming cannot do, and on streaming-only flags without it."""
    if not data_args.streaming:
        if data_args.validation_file is not None:
            raise ValueError(f"--validation_file {data_args.validation_file}: it is read with "
                             "--streaming only; add --streaming, or drop it to hold out "
                             "--validation_split_percentage of the data")
        if data_args.dataset_mixture is not None:
            raise ValueError(f"--dataset_mixture {data_args.dataset_mixture}: mixtures are "
                             "streamed; add --streaming")
        return
    if args.carry_state:
        raise ValueError("--carry_state with --streaming: carried states read the corpus as "
                         "contiguous stretches, which needs its length; drop one of them")
    if data_args.preprocessing_num_workers is not None:
        raise ValueError(f"--preprocessing_num_workers {data_args.preprocessing_num_workers} "
                         "with --streaming: a stream is packed by one reading thread; drop it")


def _check_model(
    model_args: ModelArguments, vocab_size: int, pipe_args: Optional[PipelineArguments]
) -> None:
    """Raise on an unknown attention form, sizes BDH cannot have, or an impossible pipeline."""
    BDHConfig(**model_args.attention_kwargs())
    if model_args.model_name_or_path:
        return  # the sizes are the directory's
    config = model_args.config(vocab_size)
    if pipe_args is not None:
        from dragon.parallel.pipeline import check_pipeline  # imports DeepSpeed's pipeline module

        check_pipeline(config, pipe_args.pipeline_stages, pipe_args.partition_method)


def _model_config(model_args: ModelArguments, vocab_size: int) -> BDHConfig:
    """The config this run's model will have: the directory's, or the size flags'."""
    if model_args.model_name_or_path:
        return BDHConfig.from_pretrained(model_args.model_name_or_path)
    return model_args.config(vocab_size)


def _check_carry(
    model_args: ModelArguments,
    vocab_size: int,
    pipe_args: Optional[PipelineArguments],
    rows: int,
) -> None:
    """Raise when --carry_state cannot run: a pipeline that recomputes activations (its second
    forward would advance the state twice), or states that alone exceed this rank's memory."""
    if pipe_args is not None and pipe_args.activation_checkpoint_interval:
        raise ValueError(
            "--carry_state with --activation_checkpoint_interval "
            f"{pipe_args.activation_checkpoint_interval}: a recomputed forward would carry the "
            "state twice; use --activation_checkpoint_interval 0"
        )
    config = _model_config(model_args, vocab_size)
    check_state_fits(config, rows)


def _resume_targets(
    args: TrainingArguments, diloco: DiLoCoArguments
) -> tuple[dict[int, tuple[str, str]], dict[int, tuple[str, bool]]]:
    """(island -> (load_dir, tag) for --resume_from_checkpoint, for each island this launch runs;
    island -> (the line a resume by another number of islands prints, whether it is new)). A
    run saved by I islands resumes `latest` or a tag by I' islands: island i < I from its own
    checkpoint, the others from island 0's (theta_outer, the outer optimizer's state, the
    step). Islands launched apart see only their own directory: one without checkpoints takes
    island 0's."""
    resume, root = args.resume_from_checkpoint, args.output_dir
    if not resume:
        return {}, {}
    launch = diloco.diloco_islands if diloco.enabled else 1
    together = diloco.diloco_island_index is None  # every island's directory is here
    saved = saved_islands(root) if together else None
    plain = resume == "latest" or os.sep not in resume  # a tag of this run, not a path
    targets, regrouped = {}, {}
    for island in diloco.local_islands():
        save_dir = os.path.join(diloco.output_dir(root, island), "checkpoints")
        if plain and (saved not in (None, launch) or not list_checkpoints(save_dir)):
            own = _with_checkpoints(root, island, save_dir)
            save_dir = own or _with_checkpoints(root, 0, save_dir) or save_dir
            regrouped[island] = (regroup_message(saved, launch, island, not own), not own)
        targets[island] = resolve_resume(diloco.resume_path(resume, save_dir), save_dir)
    return targets, regrouped


def _with_checkpoints(root: str, island: int, launch_dir: str) -> Optional[str]:
    """Island `island`'s checkpoints/ under `root` as it was saved (alone, or one of several
    islands), where it holds any."""
    for save_dir in (os.path.join(root, f"island{island}", "checkpoints"), launch_dir):
        if list_checkpoints(save_dir):
            return save_dir
    return None


def _check_reshape(
    resume: dict, ds_config: dict, dp_world: int, stages: int, diloco: DiLoCoArguments
) -> dict[int, str]:
    """island -> the line a resume on another layout prints (dragon.checkpoint.reshape; `stages`:
    of the
    pipeline, 0 without one); switches the engine to DeepSpeed's universal checkpoint loading
    when one converts for ZeRO-1/2/3."""
    bf16 = bool(ds_config.get("bf16", {}).get("enabled", False))
    launch = Layout(zero_stage(ds_config), dp_world, stages > 0, bf16=bf16, stages=max(stages, 1))
    reshaped = {}
    for island, (load_dir, tag) in resume.items():
        saved = saved_layout(load_dir, tag)
        message = reshape_message(saved, launch)
        if saved.global_batch and saved.global_batch != ds_config["train_batch_size"]:
            warnings.warn(
                f"--resume_from_checkpoint: the global batch changes from {saved.global_batch} "
                f"to {ds_config['train_batch_size']} samples; the data order then differs from "
                "the uninterrupted run's"
            )
        if message is not None:
            if diloco.enabled and (saved.pipeline or launch.pipeline):
                raise ValueError(f"{message[len('resume: '):]}: not yet with DiLoCo pipelines")
            if diloco.enabled:
                check_diloco_state(os.path.join(load_dir, tag))
            reshaped[island] = message
            if launch.zero_stage > 0 and not launch.pipeline:  # the others load their own form
                ds_config.setdefault("checkpoint", {})["load_universal"] = True
    return reshaped


def _check_output_dir(args: TrainingArguments, diloco: DiLoCoArguments) -> None:
    """Raise when a new run would train into another run's checkpoints (retention would mix the
    two), unless resuming it or --overwrite_output_dir."""
    if args.resume_from_checkpoint or args.overwrite_output_dir:
        return
    for island in diloco.local_islands():
        save_dir = os.path.join(diloco.output_dir(args.output_dir, island), "checkpoints")
        steps = list_checkpoints(save_dir)
        found = sorted(steps, key=steps.get)
        if found:
            raise ValueError(
                f"--output_dir {args.output_dir}: {save_dir} already holds checkpoints "
                f"({', '.join(found[-3:])}); continue that run with --resume_from_checkpoint "
                "latest, or pass --overwrite_output_dir to train a new one there"
            )


SIZES = ("n_layer", "n_embd", "n_head", "mlp_internal_dim_multiplier", "vocab_size")


def _check_resume_sizes(
    model_args: ModelArguments, vocab_size: int, resume: dict[int, tuple[str, str]]
) -> None:
    """Raise when a resume target holds a model of other sizes than this run builds."""
    config = _model_config(model_args, vocab_size)
    for load_dir, tag in resume.values():
        if not os.path.isfile(os.path.join(load_dir, "config.json")):
            continue  # a checkpoint written outside the recipes: DeepSpeed checks the shapes
        saved = BDHConfig.from_pretrained(load_dir)
        wrong = [k for k in SIZES if getattr(saved, k) != getattr(config, k)]
        if wrong:
            theirs = ", ".join(f"{k}={getattr(saved, k)}" for k in wrong)
            ours = ", ".join(f"{k}={getattr(config, k)}" for k in wrong)
            raise ValueError(
                f"--resume_from_checkpoint: {os.path.join(load_dir, tag)} holds a model with "
                f"{theirs}, this run builds {ours}; resume with the same sizes"
            )


def _warn_about_the_bubble(micro_batches: int, stages: int) -> None:
    if micro_batches < stages:
        bubble = (stages - 1) / (micro_batches + stages - 1)
        warnings.warn(
            f"{micro_batches} micro-batches (gradient_accumulation_steps) for {stages} stages: "
            f"the pipeline bubble idles {bubble:.0%} of each step; use at least {stages}"
        )


def initial_model(inputs: RecipeInputs) -> BDHForCausalLM:
    """The starting weights, identical on every rank: a save_pretrained directory or a fresh init.
    """
    torch.manual_seed(inputs.train.seed)
    if inputs.model.model_name_or_path:
        return BDHForCausalLM.from_pretrained(
            inputs.model.model_name_or_path, dtype=torch.float32, **inputs.model.attention_kwargs()
        )
    return BDHForCausalLM(inputs.model.config(inputs.tokenizer.vocab_size))
