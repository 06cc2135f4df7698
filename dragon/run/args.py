"""Argument dataclasses the recipes share, named as in transformers' TrainingArguments / run_clm.py.
"""

import re
import sys
from dataclasses import dataclass, field
from typing import Optional

from transformers import HfArgumentParser, SchedulerType

from dragon.run.config_file import apply_config_file, split_config_file
from dragon.run.faults import NAN_POLICIES, SAVE_FAILURES
from dragon.run.metrics import GPU_PEAK_TFLOPS, RECORDED_METRICS
from dragon.run.profiler import profile_window
from dragon.model.baseline import baseline_config, matched_config
from dragon.model.bdh import BDHConfig
from dragon.model.cost import parameter_count
from dragon.checkpoint.retention import RetentionPolicy
from dragon.run.diloco_args import DiLoCoArguments
from dragon.data.text import DataArguments


def _help(text: str, **kwargs):
    return field(metadata={"help": text}, **kwargs)


def check_lr_scales(args, cfg: dict, names: list[str]) -> None:
    """ValueError in one line where --lr_scales cannot apply: a pattern found in none of the
    parameter `names`, or a DeepSpeed JSON whose own scheduler sets one rate for every group."""
    if not args.lr_scales:
        return
    if "scheduler" in cfg:
        raise ValueError(f"--lr_scales {args.lr_scales}: the DeepSpeed JSON's own \"scheduler\" "
                         "sets one rate for every parameter; drop it (transformers' schedule "
                         "keeps each group's scale) or drop --lr_scales")
    for pattern in lr_scales(args.lr_scales):
        if not any(re.search(pattern, name) for name in names):
            raise ValueError(f"--lr_scales: {pattern!r} is found in no parameter's name; the "
                             f"model's are {', '.join(names)}")


OPTIMIZERS = ("adamw", "muon")
STORAGES = ("shared", "local")  # --checkpoint_storage


def lr_scales(given: Optional[str]) -> dict[str, float]:
    """--lr_scales "embed=0.5,lm_head=0.5" as {pattern: scale} (None: no scales); ValueError
    in one line."""
    scales = {}
    for item in ([] if given is None else given.split(",")):
        pattern, _, scale = item.partition("=")
        try:
            value = float(scale)
        except ValueError:
            value = 0.0
        if not pattern.strip() or not value > 0:
            raise ValueError(f"--lr_scales {given!r}: expected PATTERN=SCALE pairs with scales "
                             "> 0, separated by commas (e.g. embed=0.5,lm_head=0.5)")
        scales[pattern.strip()] = value
    return scales


@dataclass
class ModelArguments:
    model_name_or_path: Optional[str] = _help(
        "A BDH directory saved with save_pretrained (e.g. from recipes/convert_reference.py) "
        "to start from; the size flags below are then ignored.",
        default=None,
    )
    n_layer: int = _help("Layers (all share one block of weights).", default=6)
    n_embd: int = _help("Model width D.", default=256)
    n_head: int = _help("Heads nh.", default=4)
    mlp_internal_dim_multiplier: int = _help(
        "N = multiplier * D / nh neurons per head.", default=128
    )
    dropout: float = _help("Dropout on the sparse product.", default=0.1)
    attention: str = _help(
        "Attention form: auto (by sequence length), quadratic, chunked or recurrent; all exact. "
        "Also applies to --model_name_or_path.",
        default="auto",
    )
    attention_chunk_size: int = _help(
        "Positions per chunk of the chunked form.", default=BDHConfig().attention_chunk_size
    )

    model_type: str = _help(
        "bdh, or a transformer baseline trained by the same recipe: gpt2 or llama "
        "(transformers' models of --n_layer, --n_embd, --n_head, or --match_params).",
        default="bdh",
    )
    match_params: bool = _help(
        "With --model_type gpt2|llama: the width whose parameter count is nearest the BDH the "
        "size flags describe.", default=False
    )

    def attention_kwargs(self) -> dict:
        return {"attention": self.attention, "attention_chunk_size": self.attention_chunk_size}

    def config(self, vocab_size: int, positions: int):
        """The BDHConfig of the size flags, or with --model_type the baseline's config (positions:
        the longest sequence it reads)."""
        bdh = BDHConfig(
            n_layer=self.n_layer,
            n_embd=self.n_embd,
            n_head=self.n_head,
            mlp_internal_dim_multiplier=self.mlp_internal_dim_multiplier,
            dropout=self.dropout,
            vocab_size=vocab_size,
            **self.attention_kwargs(),
        )
        if self.model_type == "bdh":
            return bdh
        sizes = (vocab_size, positions, self.n_layer)
        if self.match_params:
            return matched_config(self.model_type, parameter_count(bdh), *sizes, self.n_head,
                                  self.dropout)
        return baseline_config(self.model_type, *sizes, self.n_embd, self.n_head, self.dropout)


@dataclass
class TrainingArguments:
    output_dir: str = _help("Where metrics.jsonl, checkpoints/ and final/ go.")
    deepspeed: Optional[str] = _help(
        "DeepSpeed JSON config. Under `accelerate launch` the file named by the accelerate config "
        "(deepspeed_config_file) is used when this is not given.",
        default=None,
    )
    max_steps: int = _help("Optimizer steps to train for.", default=1000)
    per_device_train_batch_size: int = _help("Micro-batch per rank (config's 'auto').", default=8)
    per_device_eval_batch_size: int = _help("Evaluation micro-batch per rank.", default=8)
    gradient_accumulation_steps: int = _help("Micro-batches per step (config's 'auto').", default=1)
    learning_rate: float = _help("Peak learning rate.", default=1e-3)
    weight_decay: float = _help("AdamW weight decay.", default=0.1)
    lr_scales: Optional[str] = _help(
        "Per-parameter learning rates: PATTERN=SCALE pairs, e.g. embed=0.5,lm_head=0.5; the "
        "first pattern (a regular expression) found in a parameter's name scales its rate "
        "(metrics.jsonl: lr/PATTERN; with Muon its matrices' lr/muon/PATTERN). Default: every "
        "parameter at --learning_rate.",
        default=None)
    adam_beta1: float = _help("AdamW beta1.", default=0.9)
    adam_beta2: float = _help("AdamW beta2.", default=0.999)
    adam_epsilon: float = _help("AdamW epsilon.", default=1e-8)
    optimizer: str = _help(
        "adamw (torch's), or muon: DeepSpeed's Muon for BDH's matrices (the encoders per head, "
        "the decoder) at --muon_learning_rate, AdamW for the embedding and the head at "
        "--learning_rate. A DeepSpeed JSON's own \"optimizer\" wins over adamw.", default="adamw")
    muon_learning_rate: float = _help("--optimizer muon: the Muon matrices' peak rate.",
                                      default=0.02)
    muon_momentum: float = _help("--optimizer muon: Muon's momentum.", default=0.95)
    max_grad_norm: float = _help("Gradient clipping (0 disables).", default=1.0)
    lr_scheduler_type: str = _help(
        "A transformers schedule name: cosine_with_min_lr (warm-up, then cosine down to "
        "--min_lr_ratio of the peak, as the BDH paper trains), cosine (to zero), linear, "
        "constant, ...",
        default="cosine_with_min_lr",
    )
    min_lr_ratio: float = _help(
        "cosine_with_min_lr's floor, as a fraction of the peak learning rate.", default=0.1
    )
    warmup_steps: int = _help("Linear warm-up steps.", default=0)
    bf16: bool = _help("bf16 mixed precision (config's bf16.enabled 'auto').", default=False)
    logging_steps: int = _help("Write a metrics line every N steps.", default=10)
    report_to: str = _help(
        "Trackers fed every metrics line through DeepSpeed's monitor, comma-separated: "
        "tensorboard, csv, wandb, comet, or none (files under <output_dir>/monitor; wandb "
        "offline with WANDB_MODE=offline). A monitor section of the JSON wins.", default="none"
    )
    eval_steps: int = _help("Evaluate every N steps (and at the end).", default=100)
    max_eval_samples: Optional[int] = _help("Validation samples used per evaluation.", default=256)
    save_steps: int = _help(
        "Save a DeepSpeed checkpoint every N steps (and at the end).", default=500
    )
    save_async: bool = _help(
        "Write checkpoints in the background: each rank copies the state into shared memory for "
        "its writer process and trains on; the checkpoint is marked once every rank's files are "
        "written (the ZeRO and pipeline recipes; the JSON's checkpoint.writer.decoupled: true "
        "too).", default=False
    )
    save_total_limit: int = _help("Checkpoints kept: the last N, plus the best one.", default=2)
    metric_for_best_model: Optional[str] = _help(
        "The metric that picks the best checkpoint (any metrics.jsonl key; 'none' keeps only "
        "the last N).",
        default="eval_loss",
    )
    greater_is_better: bool = _help(
        "The best checkpoint has the highest metric, not the lowest.", default=False
    )
    resume_from_checkpoint: Optional[str] = _help(
        "'latest' (output_dir/checkpoints), a tag of it, a path to a checkpoint directory or "
        "tag, or 'auto': 'latest' when a complete checkpoint exists, else a fresh start (one "
        "command line for a first start, a restart and, with --diloco_join, a rejoin).",
        default=None,
    )
    carry_state: bool = _help(
        "Stateful training: every row of a step is a stream through the corpus that the next step "
        "continues (with --streaming: its share of the rank's documents), and each row's "
        "attention state is carried (detached) from step to step.",
        default=False,
    )
    state_reset_steps: int = _help(
        "With --carry_state, zero every row's state every N steps (0: only when the streams wrap "
        "around the epoch).",
        default=0,
    )
    eval_carried: bool = _help(
        "Also evaluate eval_loss_carried: the validation split read as streams with the state "
        "carried (always on with --carry_state).",
        default=False,
    )
    neuron_parallel: int = _help(
        "K ranks split every head's N neurons (BDH's tensor parallelism); data parallel over "
        "world size / K. In every recipe, with DiLoCo islands, pipeline stages and --carry_state "
        "too.", default=1
    )
    seed: int = _help("Seed for weights, data order and dropout.", default=42)
    dry_run: bool = _help("Print the checked plan (topology, sizes, memory); exit.", default=False)
    plan_accelerator: str = _help(
        "The accelerator --dry_run times the run on, at its dense bf16 peak: "
        f"{', '.join(n.lower() for n in GPU_PEAK_TFLOPS)}.", default="h100"
    )
    plan_mfu: float = _help("The model FLOPs utilisation --dry_run times the run at.",
                            default=0.35)
    max_data_epochs: float = _help(
        "Most passes over the training data a run may plan; more is refused (a long run on the "
        "built-in corpus is a run whose data flags are missing). Over 4 is said in one line.",
        default=100.0,
    )
    torch_compile: bool = _help(
        "torch.compile the model (engine.compile()); losses within 1e-4 of eager's (the compiled "
        "kernels fuse and reorder fp32 sums).", default=False
    )
    gradient_checkpointing: bool = _help(
        "Recompute each layer's forward in the backward instead of keeping its activations "
        "(torch.utils.checkpoint, non-reentrant): one layer's activations at a time, for about "
        "one more forward of compute; the same losses. In the pipeline recipe it is "
        "--activation_checkpoint_interval 1.", default=False
    )
    profile_steps: Optional[str] = _help(
        "A:B: a torch.profiler trace of steps A to B on every rank, in "
        "<output_dir>/profile/rank<r>/ (TensorBoard or Perfetto open it); after step B rank 0 "
        "prints the operators that took the most self CPU time.", default=None
    )
    peak_tflops: Optional[float] = _help(
        "Peak TFLOP/s per device for MFU (default: detected).", default=None
    )
    sample_prompt: str = _help("Prompt for the sample printed at the end.", default="def ")
    sample_max_new_tokens: int = _help("Tokens in the final sample (0: none).", default=200)
    dist_timeout: float = _help("Seconds a collective may wait before failing.", default=600.0)
    break_lock: bool = _help(
        "Take over the output_dir's lock (dragon.lock) of a run that is gone, on another host; "
        "a gone run's lock on this host is taken over by itself.",
        default=False,
    )
    overwrite_output_dir: bool = _help(
        "Train into an output_dir that already holds another run's checkpoints (they stay, and "
        "retention may delete them); without it such a directory is refused unless resuming.",
        default=False,
    )
    nan_policy: str = _help(
        "A step whose loss or gradient norm is NaN or inf: skip (its update is not applied; stop "
        "after --max_bad_steps in a row) or stop.",
        default="skip",
    )
    max_bad_steps: int = _help("Consecutive skipped non-finite steps that stop the run.", default=3)
    save_failure: str = _help(
        "A save some rank could not write: stop (exit 1), or continue (train on; the next save "
        "retries). `latest` keeps naming the last complete checkpoint either way.",
        default="stop",
    )
    checkpoint_storage: str = _help(
        "shared: every node writes into one --output_dir (NFS, Lustre, a cloud mount); local: "
        "each node writes its ranks' files into --output_dir on its own disk, resumed on the "
        "same nodes or from --checkpoint_copy_to (DeepSpeed's use_node_local_storage).",
        default="shared")
    checkpoint_copy_to: Optional[str] = _help(
        "A path or fsspec URL (s3://...) that every complete checkpoint is copied to in the "
        "background; --resume_from_checkpoint PATH resumes from the copy on any nodes.",
        default=None)
    disable_tqdm: bool = _help("No progress bar.", default=False)
    local_rank: int = _help("Set by the deepspeed launcher.", default=-1)

    def _check_optimizer(self) -> None:
        lr_scales(self.lr_scales)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer {self.optimizer!r}: valid are {', '.join(OPTIMIZERS)}")

    def __post_init__(self):
        positive = ("max_steps", "per_device_train_batch_size", "per_device_eval_batch_size",
                    "gradient_accumulation_steps", "logging_steps", "eval_steps", "save_steps")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name}={getattr(self, name)}: must be >= 1")
        if self.learning_rate <= 0:
            raise ValueError(f"--learning_rate={self.learning_rate}: must be > 0")
        self._check_optimizer()
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        if self.warmup_steps < 0 or self.max_grad_norm < 0:
            raise ValueError("--warmup_steps and --max_grad_norm must be >= 0")
        valid = [t.value for t in SchedulerType]
        if self.lr_scheduler_type not in valid:
            raise ValueError(
                f"--lr_scheduler_type={self.lr_scheduler_type!r}: valid are {', '.join(valid)}"
            )
        if self.metric_for_best_model in ("none", ""):
            self.metric_for_best_model = None
        if (
            self.metric_for_best_model is not None
            and self.metric_for_best_model not in RECORDED_METRICS
        ):
            raise ValueError(
                f"--metric_for_best_model {self.metric_for_best_model!r} is never recorded; "
                f"valid are {', '.join(RECORDED_METRICS)} or none"
            )
        self.retention_policy()  # raises on a bad --save_total_limit
        if self.state_reset_steps < 0:
            raise ValueError(f"--state_reset_steps={self.state_reset_steps}: must be >= 0")
        self.eval_carried = self.eval_carried or self.carry_state
        if self.metric_for_best_model == "eval_loss_carried" and not self.eval_carried:
            raise ValueError(
                "--metric_for_best_model eval_loss_carried is recorded only with --carry_state "
                "or --eval_carried"
            )
        for name, valid in (("nan_policy", NAN_POLICIES), ("save_failure", SAVE_FAILURES),
                            ("checkpoint_storage", STORAGES)):
            if getattr(self, name) not in valid:
                raise ValueError(f"--{name}={getattr(self, name)!r}: valid are {', '.join(valid)}")
        if self.plan_accelerator.upper() not in GPU_PEAK_TFLOPS:
            raise ValueError(f"--plan_accelerator {self.plan_accelerator}: valid are "
                             f"{', '.join(n.lower() for n in GPU_PEAK_TFLOPS)}")
        if not 0 < self.plan_mfu <= 1 or self.max_data_epochs <= 0:
            raise ValueError(f"--plan_mfu {self.plan_mfu} must be in (0, 1] and "
                             f"--max_data_epochs {self.max_data_epochs} > 0")
        if self.profile_steps is not None:
            profile_window(self.profile_steps, self.max_steps)  # raises on a bad A:B
        for name in ("max_bad_steps", "max_eval_samples", "neuron_parallel"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name}={getattr(self, name)}: must be >= 1")

    def retention_policy(self) -> RetentionPolicy:
        return RetentionPolicy(self.save_total_limit, self.metric_for_best_model,
                               self.greater_is_better)


@dataclass
class PipelineArguments:
    pipeline_stages: int = _help(
        "Pipeline stages P; the data-parallel degree is world size / P.", default=2
    )
    partition_method: str = _help(
        "compute (balance BDH layers, the default), or DeepSpeed's uniform / parameters.",
        default="compute",
    )
    activation_checkpoint_interval: int = _help(
        "Recompute activations every k layers (0: off; --gradient_checkpointing is 1).", default=0
    )

    def take_gradient_checkpointing(self, on: bool) -> None:
        """--gradient_checkpointing here is DeepSpeed's recompute of every layer: interval 1."""
        interval = self.activation_checkpoint_interval
        if interval < 0 or (on and interval > 1):
            raise ValueError(
                f"--activation_checkpoint_interval {interval}"
                + (" with --gradient_checkpointing" if on else "")
                + ": valid are 0 (off) or k >= 1 layers; --gradient_checkpointing is 1"
            )
        if on:
            self.activation_checkpoint_interval = 1


def parse_arguments(pipeline: bool = False, argv: Optional[list[str]] = None) -> tuple:
    """(ModelArguments, DataArguments, TrainingArguments, DiLoCoArguments, PipelineArguments or
    None) from the command line (or `argv`); the pipeline recipe's only have the last. A YAML or
    JSON file (a run's run.json too) as the first argument gives values that the flags after it
    override (dragon.run.config_file). The pipeline recipe's --gradient_checkpointing is its
    --activation_checkpoint_interval 1."""
    types = (ModelArguments, DataArguments, TrainingArguments, DiLoCoArguments)
    parser = HfArgumentParser(types + ((PipelineArguments,) if pipeline else ()))
    path, argv = split_config_file(sys.argv[1:] if argv is None else argv)
    if path:
        apply_config_file(parser, path)
    model_args, data_args, args, diloco, *rest = parser.parse_args_into_dataclasses(args=argv)
    if pipeline:
        rest[0].take_gradient_checkpointing(args.gradient_checkpointing)
    return model_args, data_args, args, diloco, rest[0] if pipeline else None

