"""Checkpoint retention for DeepSpeed: a save completes once every rank wrote it (then its
completion marker and `latest`), and keeps the last K plus the best. Which checkpoints a directory
holds and where a resume starts: dragon.checkpoint.catalog.
"""

import json
import logging
import math
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import torch.distributed as dist

from dragon.checkpoint.catalog import (ACCEL_RE, MARKER, TAG_RE, is_complete, list_checkpoints,
                                       list_dir, parse_name, read_latest)
from dragon.checkpoint.verify import manifest
from dragon.parallel.distributed import rank
from dragon.checkpoint.writes import GuardedWrites, SaveFailed
from dragon.history import MetricHistory

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


def _remove_tree(path: str) -> None:
    shutil.rmtree(path, onerror=_ignore_missing)


def _delete(save_dir: str, name: str, remove: Callable[[str], None] = _remove_tree) -> bool:
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
    remove: Callable[[str], None] = _remove_tree,
) -> list[str]:
    """Delete the checkpoints under save_dir that the policy does not keep; returns the names
    deleted. remove(path) removes a deleted checkpoint's renamed directory (_delete).
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
            if _delete(save_dir, name, remove):
                deleted.append(name)
        except OSError as e:  # a permission problem must not kill the training run
            logger.warning("retention: could not delete %s: %s", os.path.join(save_dir, name), e)
    if deleted:
        logger.info("retention: deleted %s from %s", ", ".join(deleted), save_dir)
    return deleted


def _is_deleter(engine) -> bool:
    """Global rank 0 on shared storage; each node's local rank 0 with `use_node_local_storage`."""
    node_local = hasattr(engine, "use_node_local_storage") and bool(engine.use_node_local_storage())
    return int(getattr(engine, "local_rank", 0) if node_local else rank()) == 0


@contextmanager
def all_or_nothing(engine, save_dir: str, tag: str,
                   then: Optional[Callable[[GuardedWrites], None]] = None
                   ) -> Iterator[GuardedWrites]:
    """The writes of one save, inside: every rank's are written, or SaveFailed on every rank after
    it, and the tag directory is gone at once (it frees the space) unless `latest` names it. Then
    then(writes). With --save_async both wait for the background writes (BackgroundSaves.then)."""
    with GuardedWrites(engine) as writes:
        yield writes

    def complete() -> None:
        try:
            writes.checksums = writes.agree(f"{tag} in {save_dir}")  # every rank's
        except SaveFailed:
            if _is_deleter(engine) and read_latest(save_dir) != tag:
                _delete(save_dir, tag)
            raise
        if then is not None:
            then(writes)

    if writes.background is None:
        complete()
    else:
        writes.background.then(complete)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _history_everywhere(path: str) -> dict[int, dict]:
    """Global rank 0's history on every rank (a collective): with node-local storage only node 0 has
    it.
    """
    if not dist.is_initialized():
        return MetricHistory(path).load()
    box = [MetricHistory(path).load() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # a marker or `latest` is whole or absent


def _write_marker(tag_dir: str, info: dict) -> None:
    _write_atomically(os.path.join(tag_dir, MARKER), json.dumps(info))


def attach_retention(
    engine,
    policy: RetentionPolicy,
    expected_metrics: Iterable[str] = (),
    history_path: Optional[str] = None,
) -> None:
    """Wrap engine.save_checkpoint so that a save is complete only when every rank wrote all of
    it: then the completion marker, `latest` and the prune; else SaveFailed on every rank, and
    `latest` still names the previous checkpoint (dragon.checkpoint.writes)."""
    expected = _checked(engine, policy, expected_metrics)
    original = getattr(engine, "_dragon_save_checkpoint", None) or engine.save_checkpoint
    first_save = [True]

    def save_checkpoint(save_dir, tag=None, client_state=None, save_latest=True, **kwargs):
        save_dir = str(save_dir)
        parent, base = os.path.split(os.path.abspath(save_dir))
        accelerate = ACCEL_RE.match(base) is not None  # layout (b): each checkpoint_<i> a save_dir
        root = parent if accelerate else save_dir
        hist_file = history_path or default_history_path(root)
        if first_save[0]:  # the same on every rank
            _check_metric_recorded(policy.metric_for_best_model, expected, hist_file)
        first_save[0] = False
        client_state = {} if client_state is None else client_state
        tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"  # DeepSpeed's
        step = _step_of(engine, None if accelerate else tag, client_state)
        tag_dir = os.path.join(save_dir, tag)
        deleter = _is_deleter(engine)
        if deleter and os.path.exists(os.path.join(tag_dir, MARKER)):
            os.remove(os.path.join(tag_dir, MARKER))  # an overwritten tag is incomplete until done
        _barrier()

        def mark_and_prune(writes: GuardedWrites) -> None:  # once every rank's files are written
            history = _history_everywhere(hist_file)
            try:
                if deleter:
                    files = manifest(tag_dir, writes.checksums, skip=(MARKER,))
                    _write_marker(tag_dir, {"step": step, "tag": tag, "time": time.time(),
                                            "files": files})
                    if save_latest and rank() == 0:
                        _write_atomically(os.path.join(save_dir, "latest"), tag)
                    prune(root, policy, history, current_tag=base if accelerate else tag,
                          remove=_remover(writes))
            finally:
                # nobody starts the next save while deletion runs; a failure here still frees the
                # others
                _barrier()

        with all_or_nothing(engine, save_dir, tag, then=mark_and_prune) as writes:
            writes.run(os.makedirs, tag_dir, 0o777, True)
            result = original(save_dir, tag, client_state, False, **kwargs)
        return result

    engine._dragon_save_checkpoint = original
    engine.save_checkpoint = save_checkpoint  # an instance attribute: recipes and accelerate use it


def _checked(engine, policy: RetentionPolicy, expected_metrics: Iterable[str]) -> set:
    """attach_retention's arguments, checked: the metrics it expects, as a set."""
    if not isinstance(policy, RetentionPolicy):
        raise ValueError(f"policy must be a RetentionPolicy, got {type(policy).__name__}")
    if isinstance(expected_metrics, str):
        raise ValueError("expected_metrics must be a collection of metric names, not one string")
    ce = getattr(engine, "checkpoint_engine", None)
    if ce is not None and hasattr(ce, "is_decoupled") and ce.is_decoupled():
        # a decoupled engine is still writing when save_checkpoint returns: no point is safe to mark
        raise ValueError("attach_retention: decoupled checkpoint engines are not supported; "
                         "--save_async writes in the background instead")
    return set(expected_metrics)


def _remover(writes: GuardedWrites) -> Callable[[str], None]:
    """How a prune removes a deleted checkpoint's directory: with --save_async the writer process
    does, so that freeing its files' pages takes no training time."""
    return _remove_tree if writes.background is None else writes.background.remove


def _check_metric_recorded(metric: Optional[str], expected: set, hist_file: str) -> None:
    """Raise when the metric that picks the best checkpoint is neither expected nor in the
    history."""
    if metric is None or metric in expected:
        return
    if not any(metric in record for record in _history_everywhere(hist_file).values()):
        raise ValueError(
            f"metric_for_best_model={metric!r} is never recorded "
            f"(expected metrics {sorted(expected)}, history {hist_file})"
        )


def _step_of(engine, tag: Optional[str], client_state) -> int:
    """The step a save records: its tag's (step<N>, global_step<N>), else the client state's
    "step", else the engine's global step."""
    match = None if tag is None else TAG_RE.match(tag)
    step = client_state.get("step") if isinstance(client_state, dict) else None
    step = int(match.group(2)) if match else step if isinstance(step, int) else None
    return int(engine.global_steps) if step is None else step
