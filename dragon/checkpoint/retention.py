"""Checkpoint retention: a policy (keep the last K plus the best) and a prune that applies it to
a directory of checkpoints. The retention hook around engine.save_checkpoint prunes after each
complete save (dragon.checkpoint.save_hook). Which checkpoints a directory holds and where a
resume starts: dragon.checkpoint.catalog.
"""

import logging
import math
import os
import shutil
from dataclasses import dataclass
from typing import Any, Callable, Optional

from dragon.checkpoint.catalog import (is_complete, list_checkpoints, list_dir, parse_name,
                                       read_latest)

logger = logging.getLogger(__name__)

HISTORY = "metric_history.jsonl"
DELETING = ".deleting-"
# dragon.checkpoint.reshape's forms of a checkpoint for a launch of another layout, next to it
CONVERSIONS = ("_universal", "_zero0", "_pipeline")


@dataclass
class RetentionPolicy:
    """Keep the last `save_total_limit` checkpoints plus the best by `metric_for_best_model`."""

    save_total_limit: int = 2
    metric_for_best_model: Optional[str] = "eval_loss"
    greater_is_better: bool = False

    def __post_init__(self) -> None:
        k = self.save_total_limit
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"save_total_limit must be an integer >= 1, got {k!r}")
        m = self.metric_for_best_model
        if m is not None and (not isinstance(m, str) or not m or m == "step"):
            raise ValueError(f"metric_for_best_model must be a metric name or None, got {m!r}")
        if not isinstance(self.greater_is_better, bool):
            raise ValueError(
                f"greater_is_better must be True or False, got {self.greater_is_better!r}"
            )

    def best(self, checkpoints: dict[str, int], history: dict[int, dict]) -> Optional[str]:
        """The checkpoint whose step has the best known metric value (earliest on ties), or None."""
        sign = -1.0 if self.greater_is_better else 1.0
        scored = [
            (sign * value, step, tag)
            for tag, step in checkpoints.items()  # (value, step): ties -> earlier
            if (value := _number(history.get(step, {}).get(self.metric_for_best_model))) is not None
        ]
        return min(scored)[2] if scored and self.metric_for_best_model else None

    def select(self, checkpoints: dict[str, int], history: dict[int, dict]) -> set[str]:
        """Tags to keep: the last K by step plus the best over the whole history (pure, no I/O)."""
        ordered = sorted(checkpoints, key=lambda tag: (checkpoints[tag], tag))
        keep = set(ordered[-self.save_total_limit :])
        best = self.best(checkpoints, history)
        return keep | {best} if best is not None else keep


def _number(value: Any) -> Optional[float]:
    """A metric value usable for comparison; None when missing, not a number, NaN or inf (never
    the best, whichever way is better).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def default_history_path(root: str) -> str:
    """Where the history lives for checkpoints under `root` (outside accelerate's `checkpoints/`).
    """
    root = os.path.abspath(root)
    # accelerate's automatic naming parses a number out of every entry of `checkpoints/`: stay out
    # of it
    if os.path.basename(root) == "checkpoints":
        return os.path.join(os.path.dirname(root), HISTORY)
    return os.path.join(root, HISTORY)


def _ignore_missing(func, path, exc_info) -> None:
    if not issubclass(exc_info[0], FileNotFoundError):  # another deleter got there first: fine
        raise exc_info[1]


def remove_tree(path: str) -> None:
    shutil.rmtree(path, onerror=_ignore_missing)


def delete_checkpoint(save_dir: str, name: str, remove: Callable[[str], None] = remove_tree
                      ) -> bool:
    """Rename to a hidden name first, so a crash mid-rmtree never leaves a checkpoint-looking dir;
    then remove(the hidden dir) (with --save_async the writer process's, off the training
    thread). The checkpoint's conversions for another layout (dragon.checkpoint.reshape) go with
    it, after it.
    """
    trash = os.path.join(save_dir, DELETING + name)
    if os.path.exists(trash):
        shutil.rmtree(trash, onerror=_ignore_missing)
    try:
        os.rename(os.path.join(save_dir, name), trash)
    except FileNotFoundError:
        return False
    remove(trash)
    for suffix in CONVERSIONS:
        shutil.rmtree(os.path.join(save_dir, name + suffix), onerror=_ignore_missing)
    return True


def prune(
    save_dir: str,
    policy: RetentionPolicy,
    history: dict[int, dict],
    current_tag: Optional[str] = None,
    remove: Callable[[str], None] = remove_tree,
) -> list[str]:
    """Delete the checkpoints under save_dir that the policy does not keep; returns the names
    deleted. remove(path) removes a deleted checkpoint's renamed directory (delete_checkpoint).
    """
    for name in list_dir(save_dir):  # leftovers of a delete that crashed
        if name.startswith(DELETING) and parse_name(name[len(DELETING) :]):
            shutil.rmtree(os.path.join(save_dir, name), onerror=_ignore_missing)
    found = list_checkpoints(save_dir)
    family = parse_name(current_tag) if current_tag else None
    if family:  # a run saving `step<N>` never touches `global_step<N>` or `checkpoint_<i>`
        found = {n: s for n, s in found.items() if parse_name(n)[0] == family[0]}
    complete = {n: s for n, s in found.items() if is_complete(os.path.join(save_dir, n))}
    # Unmarked dirs older than every marked one predate retention (or another tool wrote them): not
    # ours.
    # Compared by the number in the name, since accelerate's markers hold steps and its names save
    # counts.
    oldest = min((parse_name(n)[1] for n in complete), default=None)
    half_written = {
        n for n in found if n not in complete and oldest is not None and parse_name(n)[1] > oldest
    }
    protected = {current_tag, read_latest(save_dir)}
    doomed = (set(complete) - policy.select(complete, history)) | half_written
    deleted = []
    for name in sorted(doomed - protected, key=lambda n: (found[n], n)):
        try:
            if delete_checkpoint(save_dir, name, remove):
                deleted.append(name)
        except OSError as e:  # a permission problem must not kill the training run
            logger.warning("retention: could not delete %s: %s", os.path.join(save_dir, name), e)
    if deleted:
        logger.info("retention: deleted %s from %s", ", ".join(deleted), save_dir)
    return deleted
