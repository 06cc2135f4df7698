"""The checked inputs of a run (dragon.run.preflight builds them), and the model they start from.
"""

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch
from transformers import AutoModelForCausalLM

from dragon.checkpoint.checkpointer import ResumeTarget
from dragon.data.text import DataArguments
from dragon.model.baseline import is_bdh
from dragon.model.bdh import BDHConfig, BDHForCausalLM
from dragon.run.diloco_args import DiLoCoArguments
from dragon.parallel.layout import Layout
from dragon.run.config_file import LAUNCHER_ARGUMENTS
from dragon.run.args import ModelArguments, PipelineArguments, TrainingArguments


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
    config: Any = None  # the model's: a BDHConfig, or a baseline's (--model_type)
    reshaped: dict[int, str] = field(default_factory=dict)  # island -> what the resume converts
    # island -> (the line of a resume by another number of islands, whether it is a new island)
    regrouped: dict[int, tuple[str, bool]] = field(default_factory=dict)
    layout: Layout = field(default_factory=Layout)  # islands x stages x neurons x data parallel
    resume_changes: list[str] = field(default_factory=list)  # what the resume does with them
    # (passes over the training data the run plans or None, what over): dragon.run.data
    epochs: tuple[Optional[float], str] = (None, "")

    def resume_target(self, island: int) -> Optional[ResumeTarget]:
        """What island `island` resumes from (--resume_from_checkpoint), or None."""
        if island not in self.resume:
            return None
        regrouped, new_island = self.regrouped.get(island, (None, False))
        return ResumeTarget(*self.resume[island], reshaped=self.reshaped.get(island),
                            regrouped=regrouped, new_island=new_island)

    def arguments(self) -> dict:
        """The arguments this run resolved, as a config file holds them (not the launcher's):
        run.json records them so that `recipes/<recipe>.py run.json` repeats the run."""
        values = {}
        for group in (self.model, self.data, self.train, self.diloco, self.pipeline):
            values.update(asdict(group) if group is not None else {})
        return {k: v for k, v in values.items() if k not in LAUNCHER_ARGUMENTS}

    def run_dir(self, island: int) -> str:
        """Where island `island` writes metrics.jsonl and checkpoints/ (<output_dir> without
        DiLoCo).
        """
        return self.diloco.output_dir(self.train.output_dir, island)

    def copy_to(self, island: int) -> Optional[str]:
        """Where island `island`'s checkpoints are copied (--checkpoint_copy_to: the store laid
        out as the output directory, so <store>/island<i> with several islands), or None."""
        store = self.train.checkpoint_copy_to
        return self.diloco.output_dir(store, island) if store else None


def initial_model(inputs: RecipeInputs):
    """The starting weights, identical on every rank: a save_pretrained directory or a fresh init
    (of BDH, or of the --model_type baseline: transformers' own model). With
    --gradient_checkpointing each layer's training forward is recomputed in the backward,
    through transformers' own switch (the pipeline recipe recomputes its stages' layers through
    DeepSpeed's activation_checkpoint_interval instead)."""
    torch.manual_seed(inputs.train.seed)
    if inputs.model.model_name_or_path:
        model = BDHForCausalLM.from_pretrained(
            inputs.model.model_name_or_path, dtype=torch.float32, **inputs.model.attention_kwargs()
        )
    elif not is_bdh(inputs.config):
        model = AutoModelForCausalLM.from_config(inputs.config)
    else:
        model = BDHForCausalLM(inputs.config)
    if inputs.train.gradient_checkpointing and inputs.pipeline is None:
        # non-reentrant: it takes a layer's keyword and non-tensor arguments (the carried
        # state, the rotation), and it replays the RNG state, so dropout's masks repeat
        model.activation_checkpointing_enable({"use_reentrant": False})
    return model


def model_config(model_args: ModelArguments, vocab_size: int, positions: int,
                 pipe_args: Optional[PipelineArguments]):
    """The config this run's model will have (the directory's, or the size flags'); raises on an
    unknown attention form, sizes BDH cannot have, or an impossible pipeline."""
    BDHConfig(**model_args.attention_kwargs())
    if model_args.model_name_or_path:
        if model_args.model_type != "bdh":
            raise ValueError(f"--model_type {model_args.model_type} builds a fresh baseline; "
                             "--model_name_or_path takes a BDH directory")
        return BDHConfig.from_pretrained(model_args.model_name_or_path)
    config = model_args.config(vocab_size, positions)
    if not is_bdh(config) and pipe_args is not None:
        raise ValueError(f"--model_type {model_args.model_type}: the baseline trains through "
                         "recipes/pretrain.py; the pipeline recipe splits BDH's layers only")
    if pipe_args is not None:
        from dragon.parallel.pipeline import check_pipeline  # imports DeepSpeed's pipeline module

        check_pipeline(config, pipe_args.pipeline_stages, pipe_args.partition_method)
    return config
