"""DeepSpeed JSON configs: the file is the source of truth; "auto" values come from the arguments.
"""

import importlib.util
import json
import os
import secrets
from typing import Any

from dragon.errors import warn

AUTO = "auto"
# --report_to name -> (DeepSpeed's monitor section, the package it needs, what dragon fills)
TRACKERS = {
    "tensorboard": ("tensorboard", "tensorboard", {"job_name": "bdh"}),
    "csv": ("csv_monitor", None, {"job_name": "bdh"}),
    "wandb": ("wandb", "wandb", {"project": "dragon"}),
    "comet": ("comet", "comet_ml", {"project": "dragon"}),
}


def trackers(report_to: str) -> list[str]:
    """The --report_to names; one-line ValueError for an unknown one or a missing package."""
    names = [n.strip() for n in report_to.split(",") if n.strip() and n.strip() != "none"]
    for name in names:
        if name not in TRACKERS:
            raise ValueError(f"--report_to {report_to!r}: {name!r} is not a tracker; valid are "
                             f"{', '.join(TRACKERS)} or none")
        package = TRACKERS[name][1]
        if package and importlib.util.find_spec(package) is None:
            raise ValueError(f"--report_to {name}: the {package} package is not installed "
                             f"(pip install {package})")
    return names


def load_ds_config(path: str | None) -> tuple[str, dict]:
    """Read the config named by --deepspeed, or by accelerate's config when launched by accelerate.
    """
    path = path or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if not path:
        raise ValueError(
            "no DeepSpeed config: pass --deepspeed ds_configs/zero2.json "
            "(or another file in ds_configs/)"
        )
    if not os.path.isfile(path):
        raise ValueError(f"--deepspeed {path}: no such file")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"--deepspeed {path}: not valid JSON ({e})") from None
    stage = cfg.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ValueError(
            f"--deepspeed {path}: zero_optimization.stage {stage!r}: valid are 0, 1, 2 and 3"
        )
    return path, cfg


def _fill(section: dict, key: str, value: Any) -> None:
    """Set key when it is "auto" or missing."""
    if section.get(key, AUTO) == AUTO:
        section[key] = value


def resolve_batch_sizes(cfg: dict, micro: int, accum: int, world: int) -> None:
    """Make the batch triple explicit; values the file sets win over the arguments."""
    given = {
        k: cfg.get(k, AUTO)
        for k in (
            "train_batch_size",
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
        )
    }
    tbs, m, a = given.values()
    if tbs != AUTO and (m == AUTO) != (a == AUTO):  # derive the one left open from the total
        if m == AUTO:
            m = tbs // (a * world)
        else:
            a = tbs // (m * world)
    m = micro if m == AUTO else m
    a = accum if a == AUTO else a
    tbs = m * a * world if tbs == AUTO else tbs
    if m < 1 or a < 1 or m * a * world != tbs:
        raise ValueError(
            f"DeepSpeed config: train_batch_size={tbs} != train_micro_batch_size_per_gpu={m} x "
            f"gradient_accumulation_steps={a} x world size {world}"
        )
    cfg.update(
        train_batch_size=tbs, train_micro_batch_size_per_gpu=m, gradient_accumulation_steps=a
    )


def resolve_ds_config(cfg: dict, args, world: int) -> dict:
    """A copy of cfg with every "auto" filled from TrainingArguments `args` for `world` ranks."""
    cfg = json.loads(json.dumps(cfg))
    resolve_batch_sizes(
        cfg, args.per_device_train_batch_size, args.gradient_accumulation_steps, world
    )
    _fill(cfg, "gradient_clipping", args.max_grad_norm)  # DeepSpeed would clip at 1.0 if missing
    if cfg.get("bf16", {}).get("enabled") == AUTO:
        cfg["bf16"]["enabled"] = args.bf16
    if args.optimizer == "muon":
        _muon(cfg, args)
    if "optimizer" in cfg:
        params = cfg["optimizer"].setdefault("params", {})
        _fill(params, "lr", args.learning_rate)
        _fill(params, "weight_decay", args.weight_decay)
        # Adam's betas and eps: filled when missing only for the Adam family (torch SGD rejects
        # them)
        adam = any(
            name in str(cfg["optimizer"].get("type", "")).lower() for name in ("adam", "lamb")
        )
        for key, value in (
            ("betas", [args.adam_beta1, args.adam_beta2]),
            ("eps", args.adam_epsilon),
        ):
            if adam or params.get(key) == AUTO:
                _fill(params, key, value)
    if "scheduler" in cfg:
        params = cfg["scheduler"].setdefault("params", {})
        sources = {
            "warmup_max_lr": args.learning_rate,
            "cos_max_lr": args.learning_rate,
            "warmup_num_steps": args.warmup_steps,
            "total_num_steps": args.max_steps,
        }
        for key, value in sources.items():
            if params.get(key) == AUTO:  # only "auto": a missing key keeps DeepSpeed's default
                params[key] = value
    for name in trackers(args.report_to):
        key, _, defaults = TRACKERS[name]
        section = cfg.setdefault(key, {"enabled": True})
        for field, value in defaults.items():
            section.setdefault(field, value)
        if name == "wandb":  # DeepSpeed's monitor calls wandb.init() without a directory
            os.environ.setdefault("WANDB_DIR", os.path.join(args.output_dir, "monitor"))
            # a resume continues the wandb run of the first start (run.json keeps its id)
            os.environ.setdefault("WANDB_RUN_ID", wandb_run_id(args))
            os.environ.setdefault("WANDB_RESUME", "allow")
    for name in ("tensorboard", "csv_monitor"):  # the monitors that write files
        section = cfg.get(name)
        if isinstance(section, dict) and section.get("enabled"):
            _fill(section, "output_path", os.path.join(args.output_dir, "monitor"))
    _background_writer(cfg, args)
    leftover = [k for k, v in _walk(cfg) if v == AUTO]
    if leftover:
        raise ValueError(
            f"DeepSpeed config: no argument fills 'auto' at {', '.join(leftover)}; set a value"
        )
    return cfg


def _muon(cfg: dict, args) -> None:
    """--optimizer muon: DeepSpeed's Muon ("muon": its own tagging puts matrices that are not
    embeddings or the head under Muon, the rest under its AdamW) in place of the JSON's Adam or
    AdamW (ds_configs/ name AdamW for the flags to fill; its torch_adam carries over to Muon's
    AdamW half). A JSON's Muon keeps its settings; any other optimizer is refused."""
    named = str(cfg.get("optimizer", {}).get("type", "muon"))
    if named.lower() not in ("muon", "adam", "adamw"):
        raise ValueError(f"--optimizer muon: the DeepSpeed JSON names the optimizer {named!r}; "
                         "drop its \"optimizer\" or --optimizer muon")
    if named.lower() != "muon":
        old = cfg.pop("optimizer").get("params", {})
        cfg["optimizer"] = {"type": "muon", "params": {
            k: v for k, v in old.items() if k in ("torch_adam", "weight_decay")}}
    zero = cfg.get("zero_optimization", {})
    if zero.get("stage") == 3:  # DeepSpeed's Muon refuses ZeRO-3's reduce-scatter (its default)
        if zero.get("reduce_scatter", False):
            raise ValueError("--optimizer muon with ZeRO-3: DeepSpeed's Muon does not take the "
                             "JSON's \"reduce_scatter\": true; drop it (dragon turns it off)")
        zero["reduce_scatter"] = False
    params = cfg.setdefault("optimizer", {"type": "muon"}).setdefault("params", {})
    for key, value in (("lr", args.learning_rate), ("adam_lr", args.learning_rate),
                       ("muon_lr", args.muon_learning_rate), ("momentum", args.muon_momentum),
                       ("betas", [args.adam_beta1, args.adam_beta2]), ("eps", args.adam_epsilon)):
        _fill(params, key, value)
    from dragon.parallel.deepspeed_fixes import clip_gradients_not_muon_updates  # imports deepspeed

    dropped = clip_gradients_not_muon_updates(cfg)
    if dropped:
        warn(f"--optimizer muon under ZeRO-{zero['stage']}: DeepSpeed would clip Muon's "
             "orthogonalised update rather than the gradient, so the clip at "
             f"{dropped:g} (--max_grad_norm, or the JSON's gradient_clipping) is turned off; "
             "ZeRO-0 clips the gradient")


def wandb_run_id(args) -> str:
    """The wandb run of this output directory: on a resume the id its run.json recorded, else a
    new one."""
    if args.resume_from_checkpoint:
        for run_dir in (args.output_dir, os.path.join(args.output_dir, "island0")):
            path = os.path.join(run_dir, "checkpoints", "run.json")
            if os.path.isfile(path):
                with open(path) as f:
                    recorded = json.load(f).get("wandb_run_id")
                if recorded:
                    return recorded
    return secrets.token_hex(4)


def _background_writer(cfg: dict, args) -> None:
    """The JSON's checkpoint.writer.decoupled: true asks for background saves: dragon's writer
    (--save_async) takes them, as DeepSpeed's decoupled engine does not serve on every stack
    (dragon.checkpoint.background_saves)."""
    writer = cfg.get("checkpoint", {}).get("writer")
    if isinstance(writer, dict) and writer.get("decoupled"):
        del cfg["checkpoint"]["writer"]
        args.save_async = True


def _walk(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _walk(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def zero_stage(cfg: dict) -> int:
    return int(cfg.get("zero_optimization", {}).get("stage", 0))
