"""Saves and resumes through accelerate: `accelerator.save_state(dir)` and `load_state(dir)`.

The layout is accelerate's: <run>/checkpoints/checkpoint_<step>/ is one save, DeepSpeed's files
lie in its `pytorch_model/` tag (accelerate's name for the first model), and dragon's retention
hook around engine.save_checkpoint writes the completion marker there once every rank wrote
them, then keeps the last checkpoints plus the best (dragon.checkpoint.retention, layout (b)).

accelerate writes its own files (random_states_<i>.pkl) after DeepSpeed's save returns, past the
marker. So the run's other state (the step, data position, RNG, LR schedule, carried states)
is registered with the retention hook, which writes it into the tag directory before DeepSpeed's
files, under the marker (dragon.checkpoint.save_hook), and a resume trusts those copies: a save
cut off between the marker and accelerate's files still resumes exactly.
"""

import logging
import os
from typing import Any

from dragon.checkpoint.checkpointer import Checkpointer, ResumeTarget, Saved, Stateful
from dragon.parallel.deepspeed_fixes import clip_as_configured
from dragon.parallel.distributed import rank

logger = logging.getLogger("dragon")
MODEL_TAG = "pytorch_model"  # accelerate.utils.MODEL_NAME: the tag of its first model
PROGRESS = "progress"  # <tag>/progress_<rank>.pt: the step


class Progress:
    """The step of the save in progress, one of every rank's pieces."""

    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


class AcceleratorCheckpointer(Checkpointer):
    """save(step) and resume(target) through an Accelerator that prepared `engine`; `per_rank`:
    the run's other state, saved by every rank beside DeepSpeed's files (module docstring)."""

    def __init__(self, accelerator: Any, engine, save_dir: str, per_rank: dict[str, Stateful]):
        self.progress = Progress()
        super().__init__(engine, save_dir, per_rank={PROGRESS: self.progress, **per_rank})
        self.accelerator = accelerator

    def save(self, step: int) -> str:
        """accelerator.save_state(<save_dir>/checkpoint_<step>), a collective; returns the tag
        directory. A write that fails on any rank raises SaveFailed on every rank."""
        self.check_finite(step)
        output_dir = os.path.join(self.save_dir, f"checkpoint_{step}")
        self.progress.step = step
        # client_state reaches engine.save_checkpoint, the hook: the marker records the step
        self.accelerator.save_state(output_dir, client_state={"step": step})
        return os.path.join(output_dir, MODEL_TAG)

    def resume(self, target: ResumeTarget) -> int:
        """accelerator.load_state of `target` (DeepSpeed's engine, accelerate's RNG files), then
        this rank's copies of the run's state; returns the step it was saved at."""
        self.accelerator.load_state(target.load_dir)
        clip_as_configured(self.engine)  # the run's --max_grad_norm, not the checkpoint's
        saved = Saved(os.path.join(target.load_dir, target.tag), 0, relaid=False, borrowed=False)
        progress = saved.rank_file(PROGRESS)
        if progress is None:
            raise RuntimeError(f"{saved.tag_dir} holds no {PROGRESS}_{rank()}.pt: not a "
                               "checkpoint of recipes/pretrain_accelerate.py")
        for name, state in self.per_rank.items():
            state.load_state_dict(saved.rank_file(name))
        if rank() == 0:
            logger.info(f"resumed from {target.load_dir} at step {progress['step']}")
        return progress["step"]
