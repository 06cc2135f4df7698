"""DeepSpeed checkpoints with everything resuming needs (RNG, data position, rank files), and
resume.
"""

import os
import random
from typing import Any, Optional

import numpy as np
import torch

from dragon.parallel.distributed import rank
from dragon.checkpoint.reshape import converted_tag
from dragon.checkpoint.retention import MARKER, find_resume_checkpoint


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def tag_for(step: int) -> str:
    return f"step{step}"


def save(
    engine,
    save_dir: str,
    step: int,
    client_state: dict[str, Any],
    rank_files: Optional[dict[str, Any]] = None,
) -> str:
    """engine.save_checkpoint (wrapped by dragon.checkpoint.retention.attach_retention) with each
    rank's RNG
    state and `rank_files` (name -> object, saved as <name>_<rank>.pt); returns the tag. Raises
    dragon.run.faults.SaveFailed on every rank when any rank could not write its part."""
    tag = tag_for(step)
    engine.save_checkpoint(
        save_dir,
        tag=tag,
        client_state={"step": step, **client_state},
        rank_files={"rng_state": rng_state(), **(rank_files or {})},
    )
    return tag


def resolve_resume(resume: str, save_dir: str) -> tuple[str, str]:
    """Map --resume_from_checkpoint (latest, a checkpoints dir or one tag dir) to (load_dir, tag).

    A `latest` that is missing, corrupt or names a half-written tag falls back, with a warning,
    to the newest complete checkpoint; only complete checkpoints are ever chosen.
    """
    path = save_dir if resume == "latest" else resume
    if not os.path.isdir(path):
        raise ValueError(f"--resume_from_checkpoint {resume}: no such directory ({path})")
    if os.path.isfile(os.path.join(path, MARKER)):  # one complete tag directory
        return os.path.dirname(os.path.abspath(path)), os.path.basename(os.path.normpath(path))
    try:
        return find_resume_checkpoint(path)
    except ValueError:
        raise ValueError(
            f"--resume_from_checkpoint {resume}: {path} holds no complete checkpoint"
        ) from None


def resume(engine, load_dir: str, tag: str, universal: bool = False) -> dict:
    """Load model, optimizer, scheduler and this rank's RNG; returns the client state.
    `universal`: a checkpoint of another layout, through its universal form
    (dragon.checkpoint.reshape)."""
    load_tag = tag
    if universal:
        pipeline = getattr(engine, "pipeline_parallelism", False)
        form = "pipeline" if pipeline else (
            "zero0" if engine.zero_optimization_stage() == 0 else "universal")
        parts = [int(p) for p in engine.module.parts] if pipeline else None
        load_tag = converted_tag(load_dir, tag, form, parts)
    path, client_state = engine.load_checkpoint(load_dir, tag=load_tag)
    if path is None:  # DeepSpeed only warns and carries on from fresh weights
        raise RuntimeError(
            f"no loadable DeepSpeed checkpoint in {load_dir} (tag {tag or 'from latest'})"
        )
    rng_file = os.path.join(load_dir, tag, f"rng_state_{rank()}.pt")
    if os.path.exists(rng_file):
        set_rng_state(torch.load(rng_file, weights_only=False))
    return client_state


def load_rank_file(load_dir: str, tag: str, name: str) -> Optional[Any]:
    """This rank's <name>_<rank>.pt of a checkpoint written by save(rank_files=...); None if absent.
    """
    path = os.path.join(load_dir, tag, f"{name}_{rank()}.pt")
    return (
        torch.load(path, map_location="cpu", weights_only=False) if os.path.exists(path) else None
    )
