"""The checks of --resume_from_checkpoint and --output_dir before a run starts: which checkpoint
each island resumes, on which layout, and whether it fits the model this run builds."""

import logging
import json
import os
from typing import Optional

from dragon.checkpoint.node_local import set_storage
from dragon.checkpoint.resolver import resolve_resume
from dragon.parallel.layout import Layout
from dragon.checkpoint.reshape import (regroup_message, reshape_message, saved_islands,
                                       saved_layout)
from dragon.checkpoint.catalog import has_complete, list_checkpoints
from dragon.diloco.state import check_diloco_state, saved_fragments_and_mode
from dragon.run.diloco_args import DiLoCoArguments
from dragon.run.args import TrainingArguments
from dragon.run.lock import take_run_lock
from dragon.run.resume_changes import resume_changes

logger = logging.getLogger(__name__)


def resume_targets(
    args: TrainingArguments, diloco: DiLoCoArguments
) -> tuple[dict[int, tuple[str, str]], dict[int, tuple[str, bool]]]:
    """(island -> (load_dir, tag) for --resume_from_checkpoint, for each island this launch runs;
    island -> (the line a resume by another number of islands prints, whether it is new)). A
    run saved by I islands resumes `latest` or a tag by I' islands: island i < I from its own
    checkpoint, the others from island 0's (theta_outer, the outer optimizer's state, the
    step). Islands launched apart see only their own directory: one without checkpoints takes
    island 0's."""
    resume, root = args.resume_from_checkpoint, args.output_dir
    if resume == "auto":  # one command line for a first start, a restart and a rejoin
        resume = "latest" if _anything_to_resume(root, diloco) else None
        if resume is None and int(os.environ.get("RANK", "0")) == 0:
            logger.info(f"--resume_from_checkpoint auto: no complete checkpoint under {root}; "
                        "starting fresh")
    if not resume:
        return {}, {}
    launch = diloco.diloco_islands if diloco.enabled else 1
    together = diloco.diloco_island_index is None  # every island's directory is here
    saved = saved_islands(root) if together else None
    # a tag of this run, not a path (a directory here, e.g. a store of islands, is one)
    plain = resume == "latest" or (os.sep not in resume and not os.path.isdir(resume))
    if plain and launch > 1 and saved == 1:
        _check_not_one_island(root, launch)
    targets, regrouped = {}, {}
    for island in diloco.local_islands():
        save_dir = os.path.join(diloco.output_dir(root, island), "checkpoints")
        if plain and (saved not in (None, launch) or not list_checkpoints(save_dir)):
            own = _with_checkpoints(root, island, save_dir)
            save_dir = own or _with_checkpoints(root, 0, save_dir) or save_dir
            regrouped[island] = (regroup_message(saved, launch, island, not own), not own)
        targets[island] = resolve_resume(diloco.resume_path(resume, save_dir, island), save_dir)
    return targets, regrouped


def _check_not_one_island(root: str, launch: int) -> None:
    """ValueError in one line for a run saved by one island (its checkpoints in <root>/checkpoints,
    no island directories) resumed by several: islands regroup only from island directories."""
    save_dir = os.path.join(root, "checkpoints")
    if list_checkpoints(save_dir):
        raise ValueError(
            f"--diloco_islands {launch}: {save_dir} was saved by one island, and a resume by "
            f"{launch} islands takes island directories; resume it as it was launched (without "
            "--diloco_islands), or start the islands in a new --output_dir from its weights with "
            f"--model_name_or_path {os.path.join(root, 'final')} (its export)"
        )


def _anything_to_resume(root: str, diloco: DiLoCoArguments) -> bool:
    """Whether a complete checkpoint of this run exists for any island this launch runs (its own,
    or the run's saved by another number of islands)."""
    dirs = [os.path.join(diloco.output_dir(root, i), "checkpoints") for i in diloco.local_islands()]
    dirs += [os.path.join(root, "checkpoints"), os.path.join(root, "island0", "checkpoints")]
    return any(has_complete(d) for d in dirs)


def _with_checkpoints(root: str, island: int, launch_dir: str) -> Optional[str]:
    """Island `island`'s checkpoints/ under `root` as it was saved (alone, or one of several
    islands), where it holds any."""
    for save_dir in (os.path.join(root, f"island{island}", "checkpoints"), launch_dir):
        if list_checkpoints(save_dir):
            return save_dir
    return None


def _check_groups_reshape(args: TrainingArguments, model_type: str, saved: Layout,
                          launch: Layout) -> None:
    """What a resume onto another layout cannot carry. DeepSpeed 0.19.8's universal form carries
    Adam's two moments only (deepspeed/checkpoint/ds_to_universal.py: extract_zero_shards), not
    Muon's momentum. Several parameter groups (--lr_scales; a baseline's norms and biases) go
    between ZeRO-1/2/3 layouts of whole models, whose universal loads match group to group;
    dragon's conversions to and from ZeRO-0, pipeline stages and neuron shares hold one group."""
    if args.optimizer == "muon":
        raise ValueError("--optimizer muon from a checkpoint of another layout: DeepSpeed's "
                         "universal checkpoint does not carry Muon's momentum; resume on the "
                         "layout it was saved with")
    groups = (f"--lr_scales {args.lr_scales}" if args.lr_scales else
              f"--model_type {model_type} (its norms and biases: a group without decay)"
              if model_type != "bdh" else None)
    one_group_only = [f"{what} ({side})" for side, layout in (("saved", saved), ("now", launch))
                      for what, holds in (("ZeRO-0", layout.zero_stage == 0),
                                          ("pipeline stages", layout.pipeline),
                                          ("neuron shares", layout.neurons > 1)) if holds]
    if groups and one_group_only:
        raise ValueError(f"{groups} from a checkpoint of another layout, with "
                         f"{', '.join(one_group_only)}: a resume of several parameter groups "
                         "onto another layout goes between ZeRO-1/2/3 layouts without pipeline "
                         "stages or neuron shares; resume on the layout it was saved with")


def check_reshape(
    resume: dict, ds_config: dict, layout: Layout, diloco: DiLoCoArguments,
    args: TrainingArguments, model_type: str,
) -> dict[int, str]:
    """island -> the line a resume on another layout prints (dragon.checkpoint.reshape; `layout`:
    this launch's); switches the engine to DeepSpeed's universal checkpoint loading when one
    converts for ZeRO-1/2/3 or a bf16 pipeline (its optimizer's masters)."""
    launch = layout.one_island()
    reshaped = {}
    for island, (load_dir, tag) in resume.items():
        saved = saved_layout(load_dir, tag)
        message = reshape_message(saved, launch)
        if message is not None:
            if diloco.enabled:
                check_diloco_state(os.path.join(load_dir, tag), saved.neurons)
            reshaped[island] = message
            _check_groups_reshape(args, model_type, saved, launch)
            if launch.zero_stage > 0 or (launch.pipeline and launch.bf16):  # ZeRO-0: its form
                ds_config.setdefault("checkpoint", {})["load_universal"] = True
    return reshaped


def check_storage(args: TrainingArguments, ds_config: dict, pipeline: bool,
                  diloco: DiLoCoArguments) -> None:
    """--checkpoint_storage into the DeepSpeed config; ValueError in one line where this launch
    cannot keep its checkpoints on node-local disks, or when the --checkpoint_copy_to store
    cannot be opened."""
    set_storage(args, ds_config, _why_shared(pipeline, diloco))


def _why_shared(pipeline: bool, diloco: DiLoCoArguments) -> Optional[str]:
    """Why this launch cannot keep its checkpoints on node-local disks, or None."""
    if pipeline:
        return "the pipeline recipe's export reads every stage's files from one directory"
    if diloco.enabled:
        return ("each DiLoCo island already keeps its own directory (island<i>/): run one "
                "island per node with --diloco_island_index")
    return None


def take_locks(args: TrainingArguments, diloco: DiLoCoArguments) -> None:
    """Take each island directory's lock (the launch's first rank, each node's with
    --checkpoint_storage local; not for --dry_run). Called after every other check of the start,
    since the lock creates the island directories and a refused start leaves nothing on disk."""
    first = "LOCAL_RANK" if args.checkpoint_storage == "local" else "RANK"
    if int(os.environ.get(first, "0")) == 0 and not args.dry_run:
        for island in diloco.local_islands():
            take_run_lock(diloco.output_dir(args.output_dir, island), args.break_lock)


def check_output_dir(args: TrainingArguments, diloco: DiLoCoArguments) -> None:
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


# What a model's size is, in BDH's config and in the baselines' (GPT-2, Llama); FLAGS: those
# that are the recipes' flags as they are
SIZES = ("model_type", "n_layer", "n_embd", "n_head", "mlp_internal_dim_multiplier", "vocab_size",
         "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
FLAGS = SIZES[:5]


def check_resume_sizes(config, resume: dict[int, tuple[str, str]]) -> None:
    """Raise when a resume target holds a model of another kind or other sizes than this run
    builds (`config`)."""
    ours_all = config.to_dict()
    for load_dir, tag in resume.values():
        path = os.path.join(load_dir, "config.json")
        if not os.path.isfile(path):
            continue  # a checkpoint written outside the recipes: DeepSpeed checks the shapes
        with open(path) as f:
            saved = json.load(f)
        wrong = [k for k in SIZES if saved.get(k) != ours_all.get(k)]
        if wrong:
            theirs = ", ".join(f"{k}={saved.get(k)}" for k in wrong)
            ours = ", ".join(f"{k}={ours_all.get(k)}" for k in wrong)
            flags = [f"--{k} {saved.get(k)}" for k in wrong if k in FLAGS]
            fix = (" ".join(flags) if len(flags) == len(wrong) else "the run's own arguments "
                   f"(its {os.path.join(load_dir, 'run.json')} as the config file)")
            raise ValueError(
                f"--resume_from_checkpoint: {os.path.join(load_dir, tag)} holds a model with "
                f"{theirs}, this run builds {ours}; resume with {fix}"
            )


def check_resume_fragments(resume: dict[int, tuple[str, str]], diloco: DiLoCoArguments) -> None:
    """Raise when a resume target's DiLoCo state is cut in another number of fragments, or kept
    for another mode."""
    if not diloco.enabled:
        return
    for load_dir, tag in resume.values():
        path = os.path.join(load_dir, tag)
        saved = saved_fragments_and_mode(path)
        if saved is not None and saved[0] != diloco.diloco_fragments:
            raise ValueError(
                f"--diloco_fragments {diloco.diloco_fragments}: {path} holds DiLoCo state in "
                f"{saved[0]} fragment(s); resume it with --diloco_fragments {saved[0]}")
        if saved is not None and saved[1] != diloco.diloco_mode:
            raise ValueError(
                f"--diloco_mode {diloco.diloco_mode}: {path} holds DiLoCo state of "
                f"--diloco_mode {saved[1]}; resume it with --diloco_mode {saved[1]}")


def check_resume(inputs, config) -> None:
    """Resolve --resume_from_checkpoint for every island of this launch into `inputs`
    (dragon.run.inputs.RecipeInputs); raise when it, or --output_dir, does not fit this run (a
    model of another size, other fragments, a layout that cannot convert); say which settings
    changed since the checkpoint's run; take each island directory's lock."""
    args, diloco = inputs.train, inputs.diloco
    inputs.resume, inputs.regrouped = resume_targets(args, diloco)
    check_output_dir(args, diloco)
    check_resume_sizes(config, inputs.resume)
    check_resume_fragments(inputs.resume, diloco)
    inputs.reshaped = check_reshape(inputs.resume, inputs.ds_config, inputs.layout, diloco,
                                    args, config.model_type)
    inputs.resume_changes = resume_changes(inputs)  # settings that differ: applied, or refused
    take_locks(args, diloco)  # last: it creates the island directories
