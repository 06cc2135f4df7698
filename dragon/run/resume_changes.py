"""What a resume does with training settings that differ from the checkpoint's run: each one is
said in one line, once, and is either applied from the resumed step or refused naming its flag;
none is ignored. The run's settings are those its run.json (beside the checkpoints) records, and
the global batch the one its DeepSpeed files record."""

import json
import os

from packaging.version import InvalidVersion, Version

from dragon.checkpoint.card import RUN_FILE
from dragon.checkpoint.catalog import list_checkpoints, run_files_dir
from dragon.checkpoint.reshape import saved_layout
from dragon.run.args import lr_scales
from dragon.version import __version__

SCHEDULE = "the schedule takes it from there, over the steps it was planned for"
SCHEDULE_FLAGS = ("learning_rate", "lr_scheduler_type", "warmup_steps", "min_lr_ratio")
OPTIMIZER = "the optimizer takes it from there (its saved state had the old value)"
# flag -> what a resume does with a new value (dragon.run.optim.LRSchedule applies them)
APPLIED = {
    "learning_rate": "the kept schedule is rescaled to the new peak from there",
    "lr_scheduler_type": SCHEDULE,
    "warmup_steps": SCHEDULE,
    "min_lr_ratio": SCHEDULE,
    "weight_decay": OPTIMIZER,
    "adam_beta1": OPTIMIZER,
    "adam_beta2": OPTIMIZER,
    "adam_epsilon": OPTIMIZER,
    "max_grad_norm": "gradients are clipped at it from there",
    "lr_scales": "each group's rate is the new scale of the schedule's from there",
    "muon_learning_rate": "the kept schedule is rescaled to the new peak from there",
    "muon_momentum": OPTIMIZER,
}
# the outer optimizer's saved state holds these, and H sets where the outer steps fall
REFUSED = ("diloco_outer_lr", "diloco_outer_momentum", "diloco_nesterov", "diloco_inner_steps")
BATCH = ("per_device_train_batch_size", "gradient_accumulation_steps")


def resume_changes(inputs) -> list[str]:
    """The lines of the settings this resume changes (inputs: dragon.run.inputs.RecipeInputs,
    resolved to its resume targets); ValueError in one line for a change a resume cannot make."""
    ours, lines = inputs.arguments(), []
    for load_dir, tag in inputs.resume.values():
        saved, version = _saved_run(run_files_dir(os.path.join(load_dir, tag)))
        _check_baseline_groups(saved, version, os.path.join(load_dir, tag))
        at = f"step {list_checkpoints(load_dir).get(tag, tag)}"
        changed = {k: saved[k] for k in ours if k in saved and saved[k] != ours[k]}
        for key in REFUSED:
            if key in changed and inputs.diloco.enabled:
                raise ValueError(f"--{key} {ours[key]}: {os.path.join(load_dir, tag)} was trained "
                                 f"with {changed[key]}, which its outer optimizer's state keeps; "
                                 f"resume with --{key} {changed[key]}")
        if "optimizer" in changed:
            raise ValueError(f"--optimizer {ours['optimizer']}: {os.path.join(load_dir, tag)} "
                             f"was trained with {changed['optimizer']}, whose state its "
                             f"checkpoint holds; resume with --optimizer {changed['optimizer']}")
        if "lr_scales" in changed and set(lr_scales(changed["lr_scales"])) != set(
                lr_scales(ours["lr_scales"])):
            raise ValueError(f"--lr_scales {ours['lr_scales']}: {os.path.join(load_dir, tag)} "
                             f"was trained with {changed['lr_scales']}, whose optimizer state "
                             "holds other parameter groups; resume with the same patterns (their "
                             "scales may change)")
        lines += [f"resume: --{key} {ours[key]} (the checkpoint's run: {changed[key]}): "
                  + _effect(key, inputs).replace("from there", f"from {at}")
                  for key in APPLIED if key in changed]
        lines += _batch_line(inputs, load_dir, tag, changed, at)
    return list(dict.fromkeys(lines))  # once, where several islands resume alike


# flag -> where the resolved DeepSpeed JSON holds the value the run uses
IN_JSON = {"learning_rate": ("lr", None), "weight_decay": ("weight_decay", None),
           "adam_beta1": ("betas", 0), "adam_beta2": ("betas", 1), "adam_epsilon": ("eps", None)}


def _effect(key: str, inputs) -> str:
    """What the resumed run does with the flag's new value."""
    if key == "max_grad_norm" and inputs.train.optimizer == "muon" and \
            not inputs.ds_config.get("gradient_clipping"):
        return ("no clip applies: under ZeRO dragon turns DeepSpeed's off, as it would clip "
                "Muon's update rather than the gradient")
    if _in_effect(key, inputs):
        return APPLIED[key]
    return ("the DeepSpeed JSON's own optimizer or scheduler sets it, and the resumed run keeps "
            "the JSON's")


def _in_effect(key: str, inputs) -> bool:
    """Whether the flag is what the run uses: the JSON's own optimizer values and scheduler win
    over the flags (dragon.parallel.ds_config), and a change of those is the JSON's."""
    ds = inputs.ds_config
    if key in SCHEDULE_FLAGS:
        return "scheduler" not in ds
    if key not in IN_JSON or "optimizer" not in ds:
        return True
    name, index = IN_JSON[key]
    value = ds["optimizer"].get("params", {}).get(name)
    value = value[index] if index is not None and value is not None else value
    return value == getattr(inputs.train, key)


def _batch_line(inputs, load_dir: str, tag: str, changed: dict, at: str) -> list[str]:
    before = saved_layout(load_dir, tag).global_batch
    after = inputs.ds_config["train_batch_size"]
    if not before or before == after:
        return []
    flags = ", ".join(f"--{k} {changed[k]} -> {inputs.arguments()[k]}" for k in BATCH
                      if k in changed) or "the data-parallel ranks"
    return [f"resume: the global batch changes from {before} to {after} samples ({flags}): "
            f"applied from {at}; the data order differs from the uninterrupted run's, and "
            "`tokens` counts what each step trains"]


def _saved_run(save_dir: str) -> tuple[dict, str]:
    """The saved run's arguments and the dragon version that wrote it (run.json; "0" for one
    written before run.json named it)."""
    path = os.path.join(save_dir, RUN_FILE)
    if not os.path.isfile(path):  # a checkpoint written outside the recipes
        return {}, __version__
    with open(path) as f:
        run = json.load(f)
    return run.get("arguments", {}), str(run.get("dragon_version") or "0")


NO_DECAY_GROUPS = Version("0.3.0.dev0")  # since then a baseline's norms and biases have a group


def _check_baseline_groups(saved: dict, version: str, tag_dir: str) -> None:
    model_type = saved.get("model_type", "bdh")
    if model_type == "bdh":
        return
    try:
        older = Version(version) < NO_DECAY_GROUPS
    except InvalidVersion:
        older = True
    if older:
        raise ValueError(f"--model_type {model_type}: {tag_dir} was saved by dragon {version}, "
                         "whose parameter groups differ from this one's (its norms and biases "
                         "now form a group without weight decay); resume it with dragon "
                         f"{version}, or start a fresh run")
