"""Argument dataclasses the recipes share, named as in transformers' TrainingArguments / run_clm.py."""

import os
import sys
from dataclasses import dataclass, field
from typing import Optional

from transformers import HfArgumentParser, SchedulerType

from dragon.checkpoint import resolve_resume
from dragon.data import DataArguments, TrainBatches, build_datasets, eval_batches
from dragon.diloco import DiLoCoArguments
from dragon.distributed import launcher_world_size
from dragon.ds_config import load_ds_config, resolve_ds_config
from dragon.metrics import RECORDED_METRICS
from dragon.attention import DEFAULT_CHUNK_SIZE
from dragon.model import BDHConfig
from dragon.retention import RetentionPolicy


def _help(text: str, **kwargs):
    return field(metadata={"help": text}, **kwargs)


@dataclass
class ModelArguments:
    model_name_or_path: Optional[str] = _help(
        "A BDH directory saved with save_pretrained (e.g. from recipes/convert_reference.py) to start "
        "from; the size flags below are then ignored.", default=None)
    n_layer: int = _help("Layers (all share one block of weights).", default=6)
    n_embd: int = _help("Model width D.", default=256)
    n_head: int = _help("Heads nh.", default=4)
    mlp_internal_dim_multiplier: int = _help("N = multiplier * D / nh neurons per head.", default=128)
    dropout: float = _help("Dropout on the sparse product.", default=0.1)
    attention: str = _help(
        "Attention form: auto (by sequence length), quadratic, chunked or recurrent; all exact. "
        "Also applies to --model_name_or_path.", default="auto")
    attention_chunk_size: int = _help("Positions per chunk of the chunked form.", default=DEFAULT_CHUNK_SIZE)

    def attention_kwargs(self) -> dict:
        return {"attention": self.attention, "attention_chunk_size": self.attention_chunk_size}

    def config(self, vocab_size: int) -> BDHConfig:
        return BDHConfig(
            n_layer=self.n_layer,
            n_embd=self.n_embd,
            n_head=self.n_head,
            mlp_internal_dim_multiplier=self.mlp_internal_dim_multiplier,
            dropout=self.dropout,
            vocab_size=vocab_size,
            **self.attention_kwargs(),
        )


@dataclass
class TrainingArguments:
    output_dir: str = _help("Where metrics.jsonl, checkpoints/ and final/ go.")
    deepspeed: Optional[str] = _help(
        "DeepSpeed JSON config. Under `accelerate launch` the file named by the accelerate config "
        "(deepspeed_config_file) is used when this is not given.", default=None)
    max_steps: int = _help("Optimizer steps to train for.", default=1000)
    per_device_train_batch_size: int = _help("Micro-batch per rank (config's 'auto').", default=8)
    per_device_eval_batch_size: int = _help("Evaluation micro-batch per rank.", default=8)
    gradient_accumulation_steps: int = _help("Micro-batches per step (config's 'auto').", default=1)
    learning_rate: float = _help("Peak learning rate.", default=1e-3)
    weight_decay: float = _help("AdamW weight decay.", default=0.1)
    adam_beta1: float = _help("AdamW beta1.", default=0.9)
    adam_beta2: float = _help("AdamW beta2.", default=0.999)
    adam_epsilon: float = _help("AdamW epsilon.", default=1e-8)
    max_grad_norm: float = _help("Gradient clipping (0 disables).", default=1.0)
    lr_scheduler_type: str = _help("A transformers schedule name: cosine, linear, constant, ...", default="cosine")
    warmup_steps: int = _help("Linear warm-up steps.", default=0)
    bf16: bool = _help("bf16 mixed precision (config's bf16.enabled 'auto').", default=False)
    logging_steps: int = _help("Write a metrics line every N steps.", default=10)
    eval_steps: int = _help("Evaluate every N steps (and at the end).", default=100)
    max_eval_samples: Optional[int] = _help("Validation samples used per evaluation.", default=256)
    save_steps: int = _help("Save a DeepSpeed checkpoint every N steps (and at the end).", default=500)
    save_total_limit: int = _help("Checkpoints kept: the last N, plus the best one.", default=2)
    metric_for_best_model: Optional[str] = _help(
        "The metric that picks the best checkpoint (any metrics.jsonl key; 'none' keeps only the last N).",
        default="eval_loss")
    greater_is_better: bool = _help("The best checkpoint has the highest metric, not the lowest.", default=False)
    resume_from_checkpoint: Optional[str] = _help(
        "'latest' (output_dir/checkpoints) or a path to a checkpoint directory or tag.", default=None)
    seed: int = _help("Seed for weights, data order and dropout.", default=42)
    torch_compile: bool = _help("torch.compile the model (engine.compile()); losses equal eager's.",
                                default=False)
    peak_tflops: Optional[float] = _help("Peak TFLOP/s per device for MFU (default: detected).", default=None)
    sample_prompt: str = _help("Prompt for the sample printed at the end.", default="def ")
    sample_max_new_tokens: int = _help("Tokens in the final sample (0: none).", default=200)
    dist_timeout: float = _help("Seconds a collective may wait before failing.", default=600.0)
    disable_tqdm: bool = _help("No progress bar.", default=False)
    local_rank: int = _help("Set by the deepspeed launcher.", default=-1)

    def __post_init__(self):
        positive = ("max_steps", "per_device_train_batch_size", "per_device_eval_batch_size",
                    "gradient_accumulation_steps", "logging_steps", "eval_steps", "save_steps")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name}={getattr(self, name)}: must be >= 1")
        if self.learning_rate <= 0:
            raise ValueError(f"--learning_rate={self.learning_rate}: must be > 0")
        if self.warmup_steps < 0 or self.max_grad_norm < 0:
            raise ValueError("--warmup_steps and --max_grad_norm must be >= 0")
        valid = [t.value for t in SchedulerType]
        if self.lr_scheduler_type not in valid:
            raise ValueError(f"--lr_scheduler_type={self.lr_scheduler_type!r}: valid are {', '.join(valid)}")
        if self.metric_for_best_model in ("none", ""):
            self.metric_for_best_model = None
        if self.metric_for_best_model is not None and self.metric_for_best_model not in RECORDED_METRICS:
            raise ValueError(f"--metric_for_best_model {self.metric_for_best_model!r} is never recorded; "
                             f"valid are {', '.join(RECORDED_METRICS)} or none")
        self.retention_policy()  # raises on a bad --save_total_limit
        if self.max_eval_samples is not None and self.max_eval_samples < 1:
            raise ValueError(f"--max_eval_samples={self.max_eval_samples}: must be >= 1")

    def retention_policy(self) -> RetentionPolicy:
        return RetentionPolicy(self.save_total_limit, self.metric_for_best_model, self.greater_is_better)


@dataclass
class RecipeInputs:
    """Everything a recipe needs that can be checked before any process group starts."""

    model: ModelArguments
    data: DataArguments
    train: TrainingArguments
    extra: tuple
    ds_config: dict
    train_set: object
    valid_set: object
    tokenizer: object


def parse_recipe_args(extra_types: tuple = (), data_parallel_world=None) -> RecipeInputs:
    """Parse the recipe's dataclasses and check every input; a bad one exits with one line.

    `data_parallel_world(extra_args, world_size)` gives the data-parallel degree for recipes
    whose ranks are not all data-parallel (the pipeline); it may raise ValueError.
    """
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments, *extra_types))
    try:
        model_args, data_args, args, *extra = parser.parse_args_into_dataclasses()
        world, islands = launcher_world_size(), 1
        # DiLoCoArguments() is DiLoCo off: its island paths are then the plain run's
        diloco = next((e for e in extra if isinstance(e, DiLoCoArguments)), DiLoCoArguments())
        if diloco.enabled:  # every island is a world of its own; data is split over all of them
            diloco.check_training(args)
            world, islands = diloco.island_world(world), diloco.diloco_islands
        dp_world = data_parallel_world(extra, world) if data_parallel_world else world
        _, raw_config = load_ds_config(args.deepspeed)
        ds_config = resolve_ds_config(raw_config, args, dp_world)
        train_set, valid_set, tokenizer = build_datasets(data_args)
        BDHConfig(**model_args.attention_kwargs())  # raises on an unknown form or chunk size
        if not model_args.model_name_or_path:
            model_args.config(tokenizer.vocab_size)  # raises on sizes BDH cannot be built with
        # Both raise when the data cannot fill one step / one evaluation on every rank.
        TrainBatches(train_set, ds_config["train_micro_batch_size_per_gpu"], 0, dp_world * islands,
                     ds_config["gradient_accumulation_steps"])
        eval_batches(valid_set, args.per_device_eval_batch_size, 0, dp_world, args.max_eval_samples)
        if args.resume_from_checkpoint:
            for island in diloco.local_islands():
                save_dir = os.path.join(diloco.output_dir(args.output_dir, island), "checkpoints")
                resolve_resume(diloco.resume_path(args.resume_from_checkpoint, save_dir), save_dir)
    except ValueError as e:  # DataError and config errors are ValueErrors with one-line messages
        sys.exit(f"error: {e}")
    return RecipeInputs(model_args, data_args, args, tuple(extra), ds_config, train_set, valid_set, tokenizer)


@dataclass
class PipelineArguments:
    pipeline_stages: int = _help("Pipeline stages P; the data-parallel degree is world size / P.", default=2)
    partition_method: str = _help(
        "compute (balance BDH layers, the default), or DeepSpeed's uniform / parameters.", default="compute")
    activation_checkpoint_interval: int = _help("Recompute activations every k layers (0: off).", default=0)
