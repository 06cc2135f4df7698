"""Everything a recipe checks before any process group starts: the arguments, the DeepSpeed JSON,
the data, the model's sizes and attention form, the pipeline's shape and the resume target. A bad
input raises InputRefused with one line naming it; what was built for the checks is returned for
the run (dragon.run.inputs.RecipeInputs)."""

import os
import sys
from dataclasses import replace

import torch
from transformers import AutoModelForCausalLM

from dragon.errors import InputRefused, warn
from dragon.model.baseline import is_bdh
from dragon.parallel.ds_config import load_ds_config, resolve_ds_config, zero_stage
from dragon.parallel.layout import launch_layout
from dragon.parallel.neurons import check_split
from dragon.run.args import check_lr_scales, parse_arguments
from dragon.run.data import check_data_fits, check_epochs, load_data, planned_epochs
from dragon.run.inputs import RecipeInputs, model_config
from dragon.run.plan import show_plan_or_begin
from dragon.run.resume_checks import check_resume, check_storage


def preflight(pipeline: bool = False) -> RecipeInputs:
    """Parse the recipe's arguments (PipelineArguments too for the pipeline recipe), check them."""
    if pipeline and os.environ.get("ACCELERATE_USE_DEEPSPEED"):
        raise InputRefused(
            "accelerate does not drive DeepSpeed's pipeline engine; launch with "
            "`deepspeed --num_gpus N recipes/pretrain_pipeline.py --pipeline_stages P ...` instead"
        )
    try:
        model_args, data_args, args, diloco, pipe_args = parse_arguments(pipeline)
        layout = launch_layout(args, diloco, pipe_args)
        dp_world, islands = layout.data_parallel, layout.islands
        ds_config = resolve_ds_config(load_ds_config(args.deepspeed)[1], args, dp_world)
        layout = replace(layout, zero_stage=zero_stage(ds_config), global_batch=ds_config[
            "train_batch_size"], bf16=bool(ds_config.get("bf16", {}).get("enabled", False)))
        if pipeline and zero_stage(ds_config) > 1:
            raise ValueError(
                f"--deepspeed {args.deepspeed}: ZeRO stage {zero_stage(ds_config)} cannot shard a "
                "pipeline's gradients; use stage 0 or 1 (ds_configs/pipeline_zero*.json)"
            )
        if pipeline and layout.bf16 and args.optimizer == "muon" and layout.zero_stage == 0:
            raise ValueError(  # BF16_Optimizer.__init__ (deepspeed/runtime/bf16_optimizer.py)
                "--optimizer muon with --bf16 on a ZeRO-0 pipeline: DeepSpeed's bf16 optimizer "
                "does not take Muon in a pipeline; use ds_configs/pipeline_zero1.json or fp32")
        check_storage(args, ds_config, pipeline, diloco)
        train_set, valid_set, tokenizer = load_data(data_args, args, dp_world * islands)
        config = model_config(model_args, tokenizer.vocab_size, data_args.block_size + 1,
                              pipe_args)
        if is_bdh(config):
            check_split(config.n_neurons, args.neuron_parallel)
            _check_fragments_split(config.n_neurons, args.neuron_parallel, diloco)
        else:
            _check_baseline(model_args.model_type, args, diloco)
        inputs = RecipeInputs(model_args, data_args, args, diloco, pipe_args, ds_config,
                              train_set, valid_set, tokenizer, resume={}, config=config,
                              layout=layout)
        if args.lr_scales:
            with torch.device("meta"):  # the parameters' names, nothing allocated
                model = AutoModelForCausalLM.from_config(config)
            check_lr_scales(args, ds_config, [n for n, _ in model.named_parameters()])
        check_data_fits(inputs, config, dp_world, islands)
        inputs.epochs = planned_epochs(inputs)  # once: a stream's size may ask the hub
        repeats = check_epochs(inputs)  # a run that would read its data over and over
        check_resume(inputs, config)
    except ValueError as e:  # DataError and config errors are ValueErrors with one-line messages
        raise InputRefused(str(e)) from None
    if os.environ.get("RANK", "0") == "0":  # once per launch
        split = [train_set.describe()] if data_args.streaming and dp_world * islands > 1 else []
        for line in split + ([repeats] if repeats else []) + inputs.resume_changes:
            print(line, file=sys.stderr)
    if pipeline:
        _warn_about_the_bubble(ds_config["gradient_accumulation_steps"], pipe_args.pipeline_stages)
    show_plan_or_begin(inputs, config)
    return inputs


def _check_fragments_split(n_neurons: int, k: int, diloco) -> None:
    """Fragments interleave the neurons (n mod F): each of K shares must start at a multiple of
    F for every share to hold the same part of every fragment."""
    f = diloco.diloco_fragments if diloco.enabled else 1
    if k > 1 and f > 1 and (n_neurons // k) % f:
        raise ValueError(f"--diloco_fragments {f}: each of the {k} neuron shares holds "
                         f"{n_neurons // k} neurons per head, not a multiple of it; use a "
                         f"divisor of {n_neurons // k}")


def _check_baseline(model_type: str, args, diloco) -> None:
    """One line for what BDH has and a transformer baseline has not."""
    for refused, what in ((args.neuron_parallel > 1, "--neuron_parallel (BDH's neurons)"),
                          (args.carry_state or args.eval_carried, "carried state (BDH's)")):
        if refused:
            raise ValueError(f"--model_type {model_type}: not with {what}; drop it, or train "
                             "--model_type bdh")


def _warn_about_the_bubble(micro_batches: int, stages: int) -> None:
    if micro_batches < stages:
        bubble = (stages - 1) / (micro_batches + stages - 1)
        warn(
            f"{micro_batches} micro-batches (gradient_accumulation_steps) for {stages} stages: "
            f"the pipeline bubble idles {bubble:.0%} of each step; use at least {stages}"
        )
