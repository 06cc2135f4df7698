"""One resolver for every path that names a checkpoint: the recipes' --resume_from_checkpoint and
the tools' (sample.py, export.py, reshape_checkpoint.py; verify_checkpoints.py checks the same
checkpoint a resume takes, through dragon.checkpoint.catalog.find_resume_checkpoint, which this
calls too).

A path is a Hugging Face directory, a checkpoint tag directory (DeepSpeed's stepN of the ZeRO or
the pipeline recipe, accelerate's checkpoint_N or its pytorch_model), a run's checkpoints/ or a
run's output directory (island 0's, for DiLoCo islands; a --checkpoint_copy_to store is one).
Of a run it takes "latest" (the one a resume takes: `latest`, or the newest whole checkpoint
when that is damaged), "best" (by a metric of metrics.jsonl) or a tag. A checkpoint named
outright must be whole. A resume from a store's URL fetches its latest checkpoint first.
"""

import os
import sys

from dragon.checkpoint.catalog import (ACCEL_RE, NoWholeCheckpoint, damage_of,
                                       find_resume_checkpoint, is_complete, list_checkpoints,
                                       load_dir_and_tag, looks_like_tag_dir, run_files_dir,
                                       whole_checkpoints)
from dragon.checkpoint.retention import RetentionPolicy
from dragon.checkpoint.store_copy import download, is_url
from dragon.history import MetricHistory, metrics_path


def resolve_resume(resume: str, save_dir: str) -> tuple[str, str]:
    """--resume_from_checkpoint as (load_dir, tag): `latest` or a tag of this run's `save_dir`
    (an island's), or any path resolve_checkpoint takes, of which the checkpoint a resume takes.
    Every rank checks every file's size and CRC-32 (a superset of the files it reads), so all
    ranks choose the same checkpoint before any process group exists to agree on one."""
    path = save_dir if resume == "latest" else resume
    if is_url(resume):  # a --checkpoint_copy_to store: fetched to this disk first
        path = download(resume, os.path.dirname(os.path.abspath(save_dir)))
    if not os.path.isdir(path) and os.sep not in resume:  # a tag of this run's checkpoints
        path = os.path.join(save_dir, resume)
    try:
        _, tag_dir = _resolve(os.path.normpath(path), "latest", "eval_loss", weights_only=False)
    except ValueError as e:
        raise ValueError(f"--resume_from_checkpoint {resume}: {e}") from None
    return os.path.dirname(os.path.abspath(tag_dir)), os.path.basename(tag_dir)


def resolve_checkpoint(path: str, checkpoint: str = "best", metric: str = "eval_loss") -> str:
    """The checkpoint (or Hugging Face) directory PATH names (the module's docstring), as a tool
    takes it: `checkpoint` "best", "latest" or a tag. Says on stderr in one line what it found and
    chose; ValueError naming PATH otherwise."""
    found, chosen = _resolve(os.path.normpath(path), checkpoint, metric)
    print(f"{path}: {found}; takes {chosen}", file=sys.stderr)
    return chosen


def is_hf_directory(path: str) -> bool:
    names = os.listdir(path) if os.path.isdir(path) else []
    return "config.json" in names and any(n.endswith((".safetensors", ".bin")) for n in names)


def _resolve(path: str, checkpoint: str, metric: str, weights_only: bool = True
             ) -> tuple[str, str]:
    """(what `path` is, the directory to load) for resolve_checkpoint; `weights_only`: a Hugging
    Face directory serves (a resume needs a checkpoint)."""
    if not os.path.isdir(path):
        raise ValueError(f"{path}: no such directory")
    if is_hf_directory(path):
        if not weights_only:
            raise ValueError(f"{path} is a Hugging Face directory (weights only); start a run "
                             f"from it with --model_name_or_path {path}")
        return "a Hugging Face directory", path
    if ACCEL_RE.match(os.path.basename(path)) and is_complete(path):  # accelerate's save_state
        return "accelerate's checkpoint", _whole(os.path.join(*load_dir_and_tag(
            os.path.dirname(path), os.path.basename(path))))
    if _is_tag_dir(path):
        return "a checkpoint tag directory", _whole(path)
    if os.path.basename(path) == "checkpoints":
        path = os.path.dirname(path) or "."
    if os.path.isdir(os.path.join(path, "island0")):
        path = os.path.join(path, "island0")
    save_dir = os.path.join(path, "checkpoints")
    if not os.path.isdir(save_dir):
        raise ValueError(
            f"{path}: neither a Hugging Face directory, a checkpoint tag directory, nor a run's "
            "output directory (no checkpoints/)"
        )
    found = f"a run's checkpoints ({len(list_checkpoints(save_dir))} in {save_dir})"
    if checkpoint not in ("best", "latest"):
        named = os.path.join(save_dir, checkpoint)
        if not is_complete(named):
            raise ValueError(f"--checkpoint {checkpoint}: {named} is not a complete checkpoint")
        return found, _whole(os.path.join(*load_dir_and_tag(save_dir, checkpoint)))
    try:
        latest = os.path.join(*find_resume_checkpoint(save_dir))
    except NoWholeCheckpoint as e:  # saved, and every one damaged: each is named
        raise ValueError(f"{path}: {e}") from None
    except ValueError:
        raise ValueError(
            f"{path}: no complete checkpoint in {save_dir} yet; pass a run that has saved one, "
            f"a checkpoint tag directory{' or a Hugging Face directory' if weights_only else ''}"
        ) from None
    if checkpoint == "latest":
        return f"{found}, the one a resume takes", latest
    history = MetricHistory(metrics_path(path)).load()
    best = RetentionPolicy(metric_for_best_model=metric).best(
        whole_checkpoints(save_dir, checksums=True), history)
    if not best:
        return f"{found}, none with {metric}: the latest", latest
    return f"{found}, the best by {metric}", os.path.join(*load_dir_and_tag(save_dir, best))


def _whole(tag_dir: str) -> str:
    problem = damage_of(tag_dir, checksums=True)
    if problem:
        raise ValueError(f"{tag_dir} is damaged ({problem}); name another checkpoint")
    return tag_dir


def _is_tag_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(run_files_dir(path), "config.json")) and (
        looks_like_tag_dir(path))
