"""The retention hook: dragon's one wrap of engine.save_checkpoint. Whoever calls DeepSpeed's save
(a recipe's Checkpointer, a user's own loop, accelerate's save_state) gets one sequence,
SaveHook.__call__:

1. the rank files: the per-rank pieces registered with the hook (a Checkpointer's RNG, DiLoCo
   and carried states), as <tag>/<name>_<rank>.pt; none when no Checkpointer registered any;
2. DeepSpeed's own save;
3. every rank's writes agreed: else SaveFailed on every rank, and the half-written tag removed
   unless `latest` names it;
4. the completion marker (the manifest of its files, sizes, CRC-32s) and `latest`;
5. the prune: the last K plus the best (dragon.checkpoint.retention);
6. with --checkpoint_copy_to, the copy to the store begins (dragon.checkpoint.store_copy).

Steps 3-6 are SaveHook.complete: a synchronous save runs it at once; a background save
(--save_async) hands it to its BackgroundSaves, which runs it on the training thread once every
rank's writer process has reported (dragon.checkpoint.background_saves). DeepSpeed's writes reach
the save's GuardedWrites through the GuardedCheckpointEngine that the hook sets once, when it is
attached (dragon.checkpoint.writes).

With node-local storage (dragon.checkpoint.node_local) each node's first rank writes the marker,
`latest` and the prune of its own directory, and its marker names the ranks whose files it holds.
A hook that no one attached retention to (a Checkpointer on a bare engine) writes no marker and
prunes nothing: its step 4 is `latest` alone.
"""

import functools
import json
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Protocol

import torch
import torch.distributed as dist

from dragon.checkpoint.background_saves import BackgroundSaves
from dragon.checkpoint.catalog import ACCEL_RE, MARKER, TAG_RE, read_latest
from dragon.checkpoint.node_local import node_entry, ranks_on_this_node, uses_node_local_storage
from dragon.checkpoint.retention import (RetentionPolicy, default_history_path,
                                         delete_checkpoint, prune, remove_tree)
from dragon.checkpoint.store_copy import StoreCopy
from dragon.checkpoint.verify import manifest
from dragon.checkpoint.writes import GuardedCheckpointEngine, GuardedWrites, SaveFailed
from dragon.history import MetricHistory
from dragon.parallel.deepspeed_fixes import guard_checkpoint_writes
from dragon.parallel.distributed import rank


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


@dataclass
class Retention:
    """What attach_retention asked for: the policy, the metrics the run records, the history."""

    policy: RetentionPolicy
    expected_metrics: set[str]
    history_path: Optional[str] = None  # None: beside the checkpoints (default_history_path)
    metric_checked: bool = False  # the metric that picks the best was found, at the first save

    def history_file(self, root: str) -> str:
        return self.history_path or default_history_path(root)


@dataclass
class Save:
    """One save in progress, as each step of the sequence sees it."""

    save_dir: str
    tag: str
    step: int  # what the marker records
    root: str  # where the checkpoints to prune lie: save_dir, or accelerate's checkpoints/
    name: str  # this checkpoint's name under root: the tag, or accelerate's checkpoint_<i>
    client_state: dict
    save_latest: bool
    writes: GuardedWrites = field(default_factory=GuardedWrites)
    files: Optional[dict] = None  # the marker's manifest, on the rank that wrote the marker

    @property
    def tag_dir(self) -> str:
        return os.path.join(self.save_dir, self.tag)


class SaveHook:
    """engine.save_checkpoint, with dragon's save around DeepSpeed's (module docstring)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.deepspeed_save = engine.save_checkpoint  # the engine's own bound method
        self.retention: Optional[Retention] = None  # attach_retention's
        self.rank_pieces: dict[str, Stateful] = {}  # written by every rank at every save
        self.background: Optional[BackgroundSaves] = None  # --save_async: a Checkpointer's
        self.guard: Optional[GuardedCheckpointEngine] = None
        self.copy: Optional[StoreCopy] = None  # --checkpoint_copy_to
        self.node: Optional[dict] = None  # node-local storage: this node's marker entry
        if getattr(engine, "checkpoint_engine", None) is not None:
            self.guard = GuardedCheckpointEngine(engine.checkpoint_engine)
            guard_checkpoint_writes(engine, self.guard)

    def register_rank_pieces(self, pieces: dict[str, Stateful]) -> None:
        """Have every later save write each piece's state_dict() as <tag>/<name>_<rank>.pt."""
        self.rank_pieces.update(pieces)

    def __call__(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                 **kwargs) -> Any:
        """DeepSpeed's save_checkpoint (the same arguments and result), as one sequence."""
        if self.background is not None:  # the save in flight completes first (a Checkpointer
            self.background.complete()  # waits already; a user's own loop may not)
        save = self.begin(str(save_dir), tag, client_state, save_latest)
        self.write_rank_files(save)  # 1
        recording = self.guard.recording(save.writes) if self.guard else nullcontext()
        with recording:  # 2; `latest` waits for step 4
            result = self.deepspeed_save(save.save_dir, save.tag, save.client_state, False,
                                         **kwargs)
        if self.background is None:
            self.complete(save)  # 3-5 now
        else:  # 3-5 once every rank's writer has written its files
            self.background.then(functools.partial(self.complete, save))
            self.background.start()  # returns once the files' states are copied for the writer
        return result

    def complete(self, save: Save) -> None:
        """Steps 3-6, once every rank's files are written (a collective)."""
        if self.copy is not None:  # the copy in flight reads files that the prune may remove
            self.copy.wait()
        self.agree(save)  # 3
        history = self.history(save)
        failed = GuardedWrites()  # the writer's marker or `latest` that could not be written
        if is_directory_writer(self.engine):
            failed.run(self.mark, save, path=os.path.join(save.tag_dir, MARKER))  # 4
            if failed.error is None:
                self.prune(save, history)  # 5
        # every rank learns it together (and nobody starts the next save while deletion runs)
        failed.agree(f"the completion marker of {save.tag} in {save.save_dir}")
        if self.copy is not None:  # 6
            self.copy.start(save.save_dir, save.tag, save.step, save.files)

    def begin(self, save_dir: str, tag: Optional[str], client_state: Optional[dict],
              save_latest: bool) -> Save:
        """The save's names and step; the metric check at the first save (before anything is
        written); an overwritten tag unmarked, since it is incomplete until all is new."""
        parent, base = os.path.split(os.path.abspath(save_dir))
        accelerate = ACCEL_RE.match(base) is not None  # layout (b): each checkpoint_<i> a save_dir
        client_state = {} if client_state is None else client_state
        # DeepSpeed's default tag
        tag = str(tag) if tag is not None else f"global_step{self.engine.global_steps}"
        step = _step_of(self.engine, None if accelerate else tag, client_state)
        save = Save(save_dir, tag, step, root=parent if accelerate else save_dir,
                    name=base if accelerate else tag, client_state=client_state,
                    save_latest=save_latest, writes=GuardedWrites(self.background))
        if self.retention is not None and not self.retention.metric_checked:  # the same everywhere
            _check_metric_recorded(self.retention, save.root)
            self.retention.metric_checked = True
        if is_directory_writer(self.engine):
            _unmark(save.tag_dir)
        if uses_node_local_storage(self.engine) and self.node is None:  # once (a collective)
            self.node = node_entry(ranks_on_this_node())
        _barrier()
        return save

    def write_rank_files(self, save: Save) -> None:
        """Step 1: every registered piece, before DeepSpeed's files, so that a marked checkpoint
        holds them all."""
        save.writes.run(os.makedirs, save.tag_dir, 0o777, True)
        for name, piece in self.rank_pieces.items():
            path = os.path.join(save.tag_dir, f"{name}_{rank()}.pt")
            save.writes.save(piece.state_dict(), path, torch.save)

    def agree(self, save: Save) -> None:
        """Step 3: every rank's writes succeeded, and their CRC-32s are known here; else
        SaveFailed on every rank, and the tag directory is gone at once (it frees the space)
        unless `latest` names it."""
        try:
            save.writes.checksums = save.writes.agree(f"{save.tag} in {save.save_dir}")
        except SaveFailed:
            if is_directory_writer(self.engine) and read_latest(save.save_dir) != save.tag:
                delete_checkpoint(save.save_dir, save.tag)
            raise

    def history(self, save: Save) -> dict[int, dict]:
        """The metric history that picks the best (a collective), {} without retention."""
        if self.retention is None:
            return {}
        return _history_everywhere(self.retention.history_file(save.root))

    def mark(self, save: Save) -> None:
        """Step 4, on the directory writer: the completion marker with the manifest (with
        retention), then `latest`."""
        if self.retention is not None:
            save.files = manifest(save.tag_dir, save.writes.checksums, skip=(MARKER,))
            info = {"step": save.step, "tag": save.tag, "time": time.time(), "files": save.files}
            if self.node is not None:
                info["node"] = self.node
            _write_atomically(os.path.join(save.tag_dir, MARKER), json.dumps(info))
        if save.save_latest:  # by this directory's writer
            _write_atomically(os.path.join(save.save_dir, "latest"), save.tag)

    def prune(self, save: Save, history: dict[int, dict]) -> None:
        """Step 5, on the directory writer: the checkpoints the policy does not keep go; with
        --save_async the writer process removes them, so that freeing their pages takes no
        training time."""
        if self.retention is None:
            return
        remove = remove_tree if save.writes.background is None else save.writes.background.remove
        prune(save.root, self.retention.policy, history, current_tag=save.name, remove=remove)


def hook_of(engine: Any) -> Optional[SaveHook]:
    """The SaveHook that is `engine`'s save_checkpoint, or None."""
    save = getattr(engine, "save_checkpoint", None)
    return save if isinstance(save, SaveHook) else None


def attach_save_hook(engine: Any) -> SaveHook:
    """`engine`'s SaveHook, attached now if it has none (without retention)."""
    hook = hook_of(engine)
    if hook is None:
        hook = SaveHook(engine)
        engine.save_checkpoint = hook  # an instance attribute: recipes and accelerate call it
    return hook


def attach_retention(
    engine: Any,
    policy: RetentionPolicy,
    expected_metrics: Iterable[str] = (),
    history_path: Optional[str] = None,
    copy_to: Optional[str] = None,
) -> SaveHook:
    """Make every save of `engine` complete only when every rank wrote all of it: then the
    completion marker, `latest` and the prune by `policy`; else SaveFailed on every rank, and
    `latest` still names the previous checkpoint. `copy_to`: a store (a path or fsspec URL)
    that every complete checkpoint is copied to, beside `history_path`'s run directory. Attached
    again, the new policy replaces the old one."""
    expected = _checked(engine, policy, expected_metrics)
    hook = attach_save_hook(engine)
    hook.retention = Retention(policy, expected, history_path)
    if copy_to:
        hook.copy = StoreCopy(copy_to, os.path.dirname(history_path or ""))
    return hook


def _checked(engine: Any, policy: RetentionPolicy, expected_metrics: Iterable[str]) -> set[str]:
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


def _check_metric_recorded(retention: Retention, root: str) -> None:
    """Raise when the metric that picks the best checkpoint is neither expected nor in the
    history."""
    metric = retention.policy.metric_for_best_model
    if metric is None or metric in retention.expected_metrics:
        return
    history_file = retention.history_file(root)
    if not any(metric in record for record in _history_everywhere(history_file).values()):
        raise ValueError(
            f"metric_for_best_model={metric!r} is never recorded "
            f"(expected metrics {sorted(retention.expected_metrics)}, history {history_file})"
        )


def _step_of(engine: Any, tag: Optional[str], client_state: dict) -> int:
    """The step a save records: its tag's (step<N>, global_step<N>), else the client state's
    "step", else the engine's global step."""
    match = None if tag is None else TAG_RE.match(tag)
    step = client_state.get("step") if isinstance(client_state, dict) else None
    step = int(match.group(2)) if match else step if isinstance(step, int) else None
    return int(engine.global_steps) if step is None else step


def is_directory_writer(engine: Any) -> bool:
    """Whether this rank writes the files of its checkpoint directory that no rank owns (marker,
    `latest`, run files) and prunes it: global rank 0 on shared storage; each node's local rank
    0 with `use_node_local_storage`."""
    return int(getattr(engine, "local_rank", 0) if uses_node_local_storage(engine) else rank()) == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _history_everywhere(path: str) -> dict[int, dict]:
    """Global rank 0's history on every rank (a collective): with node-local storage only node 0
    has it."""
    if not dist.is_initialized():
        return MetricHistory(path).load()
    box = [MetricHistory(path).load() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _unmark(tag_dir: str) -> None:
    try:
        os.remove(os.path.join(tag_dir, MARKER))
    except FileNotFoundError:
        pass


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # a marker or `latest` is whole or absent
