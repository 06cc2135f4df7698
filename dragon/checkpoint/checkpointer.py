"""One Checkpointer saves and resumes a run: the engine's own state through
engine.save_checkpoint / load_checkpoint, and every other piece of run state beside it.

Each piece is an object with state_dict() / load_state_dict() (torchtitan's Stateful):
- `shared` pieces are the same on every rank (the data position): saved once, in DeepSpeed's
  client state;
- `per_rank` pieces differ by rank (RNG, carried states, DiLoCo's outer state, a stream's
  position): registered with the engine's retention hook, which writes them as
  <tag>/<name>_<rank>.pt before DeepSpeed's files, so that a checkpoint whose completion marker
  exists holds them all (dragon.checkpoint.save_hook).

A resume loads what the checkpoint holds for this rank. A piece whose own saved state is missing,
or was saved by another layout (dragon.checkpoint.reshape) or by another island, is handed the
whole checkpoint instead through its `resume_elsewhere(saved)`, when it has one.

With `save_async` (--save_async) a save returns once its files' states are copied into shared
memory for the rank's writer process (the copy is the snapshot); the save completes at a later
poll() (dragon.checkpoint.background_saves; the hook owns the BackgroundSaves).
A save waits for the one in flight first, and wait() (a preemption's save, the last one) waits
for both.
"""

import logging
import os
import random
from dataclasses import dataclass, replace
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

from dragon.checkpoint.background_saves import BackgroundSaves
from dragon.checkpoint.catalog import last_complete
from dragon.checkpoint.node_local import agree_on_tag, names_a_tag, uses_node_local_storage
from dragon.checkpoint.reshape import converted_tag
from dragon.checkpoint.save_hook import Stateful, attach_save_hook
from dragon.errors import TrainingFailed
from dragon.parallel.deepspeed_fixes import clip_as_configured, groups_kept_through_a_load
from dragon.parallel.distributed import all_reduce_values, rank
from dragon.parallel.neurons import universal_share_group

logger = logging.getLogger("dragon")
RNG_STATE = "rng_state"  # <tag>/rng_state_<rank>.pt


@dataclass
class ResumeTarget:
    """A checkpoint to resume from, as preflight resolved it."""

    load_dir: str
    tag: str
    reshaped: Optional[str] = None  # a resume on another layout's line (dragon.checkpoint.reshape)
    regrouped: Optional[str] = None  # the line of a resume by another number of islands
    new_island: bool = False  # this island did not exist then: it takes island 0's checkpoint


@dataclass
class Saved:
    """A checkpoint being resumed, as the pieces that cannot load their own state see it."""

    tag_dir: str
    step: int
    relaid: bool  # saved on another layout: every rank's files are another partition's
    borrowed: bool  # another island's checkpoint (a new island's start)

    def rank_file(self, name: str, of_rank: Optional[int] = None) -> Optional[Any]:
        """<name>_<rank>.pt of this rank (or `of_rank`), None when absent."""
        path = os.path.join(self.tag_dir, f"{name}_{rank() if of_rank is None else of_rank}.pt")
        if not os.path.exists(path):
            return None
        return torch.load(path, map_location="cpu", weights_only=False)


class RNGState:
    """Python's, numpy's and torch's generators (CUDA's too, where there is one). A rank that
    resumes from another island's checkpoint seeds torch with `seed` + step, as a fresh run seeds
    it with `seed`: so every rank of every island draws its own dropout masks."""

    def __init__(self, seed: int):
        self.seed = seed

    def state_dict(self) -> dict:
        state = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])

    def resume_elsewhere(self, saved: Saved) -> None:
        own = saved.rank_file(RNG_STATE)
        if own is not None:  # another layout's rank r: its generators, as good as any
            self.load_state_dict(own)
        if saved.borrowed:  # island 0's masks are not this island's
            torch.manual_seed(self.seed + saved.step)


def tag_for(step: int) -> str:
    return f"step{step}"


class Checkpointer:
    """save(step) and resume(target) of one engine and the run's other state (module docstring).
    """

    def __init__(
        self,
        engine,
        save_dir: str,
        shared: Optional[dict[str, Stateful]] = None,
        per_rank: Optional[dict[str, Stateful]] = None,
        save_async: bool = False,
    ):
        self.engine, self.save_dir = engine, save_dir
        self.shared, self.per_rank = dict(shared or {}), dict(per_rank or {})
        # every save of the engine goes through its hook: one without retention where no one
        # attached any (no marker, no prune)
        self.hook = attach_save_hook(engine)
        self.hook.register_rank_pieces(self.per_rank)
        if self.hook.background is not None:  # another Checkpointer's save in flight ends first
            self.hook.background.complete()
        self.hook.background = BackgroundSaves() if save_async else None

    @property
    def background(self) -> Optional[BackgroundSaves]:
        """Where the saves' files are written with save_async (the hook's)."""
        return self.hook.background

    def save(self, step: int, wait: bool = False) -> str:
        """Save as tag step<step> (engine.save_checkpoint is collective: every rank calls this);
        returns the tag directory. The hook writes the per-rank pieces, then DeepSpeed's files; a
        write that fails on any rank raises SaveFailed on every rank (dragon.checkpoint.writes);
        with save_async, when the save completes (at a later poll(), or in wait()). `wait`:
        return only once the save is complete."""
        self.wait()  # the save in flight completes first
        self.check_finite(step)
        tag = tag_for(step)
        client_state = {name: state.state_dict() for name, state in self.shared.items()}
        self.engine.save_checkpoint(self.save_dir, tag=tag, client_state={"step": step,
                                                                          **client_state})
        if wait:
            self.wait()
        return os.path.join(self.save_dir, tag)

    def poll(self) -> None:
        """Complete the save in flight if every rank has written it (a collective: every rank
        calls this after every step); else return at once."""
        if self.background is not None:
            self.background.poll()

    def wait(self) -> None:
        """Wait for the save in flight and complete it (a collective), and for this rank's copy
        to the --checkpoint_copy_to store."""
        if self.background is not None:
            self.background.complete()
        if self.hook.copy is not None:
            self.hook.copy.wait()

    def check_finite(self, step: int) -> None:
        """Raise TrainingFailed, on every rank, when the weights are not finite: never saved."""
        if not weights_finite(self.engine):
            raise TrainingFailed(f"step {step}: weights hold NaN or inf, not saved; last "
                                 f"complete checkpoint: {self.last_complete()}")

    def last_complete(self) -> str:
        """The checkpoint a resume would take now, or "none"."""
        return last_complete(self.save_dir)

    def agreed(self, target: Optional[ResumeTarget], resume: Optional[str]
               ) -> Optional[ResumeTarget]:
        """`target`, or where each node keeps its own checkpoints, the one that every node holds
        (a collective there: dragon.checkpoint.node_local); `resume`: --resume_from_checkpoint
        as given."""
        if not uses_node_local_storage(self.engine):
            return target
        tag = agree_on_tag(self.save_dir, target and (target.load_dir, target.tag),
                           names_a_tag(resume))
        if tag is None or (target is not None and target.tag == tag):
            return target
        return replace(target, tag=tag) if target else ResumeTarget(self.save_dir, tag)

    def resume(self, target: ResumeTarget) -> int:
        """Load the engine (weights, optimizer, LR schedule) and every piece from `target`;
        returns the step it was saved at."""
        for line in (target.reshaped, target.regrouped):  # a resume on another layout says so
            if line and rank() == 0:
                logger.info(line)
        load_dir, load_tag = target.load_dir, target.tag
        if target.reshaped:  # through the form this layout loads, written in this run's dir
            load_dir, load_tag = converted_tag(target.load_dir, target.tag,
                                               *_loadable_form(self.engine), out_dir=self.save_dir)
        with universal_share_group(self.engine):
            path, client_state = load_engine(self.engine, load_dir, load_tag)
        if path is None:  # DeepSpeed only warns and carries on from fresh weights
            raise RuntimeError(f"no loadable DeepSpeed checkpoint in {target.load_dir} "
                               f"(tag {target.tag or 'from latest'})")
        step = client_state["step"]
        if rank() == 0:
            logger.info(f"resumed from {os.path.join(target.load_dir, target.tag)} at step {step}")
        another = bool(target.reshaped or target.regrouped)
        saved = Saved(os.path.join(target.load_dir, target.tag), step,
                      relaid=bool(target.reshaped), borrowed=target.new_island)
        for name, state in self.shared.items():  # the same everywhere: kept, then moved on
            if name in client_state:
                state.load_state_dict(client_state[name])
            if another or name not in client_state:
                _resume_elsewhere(state, saved)
        for name, state in self.per_rank.items():
            own = None if another or target.new_island else saved.rank_file(name)
            if own is None:
                _resume_elsewhere(state, saved)
            else:
                state.load_state_dict(own)
        return step


def load_engine(engine, load_dir: str, tag: str) -> tuple[Optional[str], dict]:
    """engine.load_checkpoint. DeepSpeed's bf16 optimizer outside ZeRO (a bf16 pipeline on
    ZeRO-0) is handed the model states' optimizer dict where it takes a list of its data-parallel
    ranks' files and fails; such an engine loads everything else first, then its optimizer's own
    files (or the universal folder) as under ZeRO. The gradient clip is then the run's own, not
    the checkpoint's (dragon.parallel.deepspeed_fixes.clip_as_configured)."""
    if engine.zero_optimization() or not isinstance(engine.optimizer, BF16_Optimizer):
        with groups_kept_through_a_load(engine):
            path, client_state = engine.load_checkpoint(load_dir, tag=tag)
    else:
        path, client_state = engine.load_checkpoint(load_dir, tag=tag,
                                                    load_optimizer_states=False)
        if path is not None:
            engine._load_zero_checkpoint(load_dir, tag)
            if engine.load_universal_checkpoint():  # the bf16 weights from the fp32 masters
                engine.optimizer.update_lp_params()
    clip_as_configured(engine)
    return path, client_state


def _resume_elsewhere(state: Stateful, saved: Saved) -> None:
    """A piece's own resume from a checkpoint that holds no state of it as it is now; a piece
    without one keeps its fresh state."""
    if hasattr(state, "resume_elsewhere"):
        state.resume_elsewhere(saved)


def weights_finite(engine) -> bool:
    """Whether every rank's weights (its ZeRO-3 partitions) are finite: a collective."""
    finite = all(_finite(getattr(p, "ds_tensor", p)) for p in engine.module.parameters())
    return all_reduce_values([float(not finite)], dist.ReduceOp.MAX)[0] == 0


def _finite(tensor: torch.Tensor) -> bool:
    """Whether every value is finite: its least and greatest are (a NaN anywhere makes both NaN),
    in one pass that allocates nothing of the tensor's size."""
    if tensor.numel() == 0:
        return True
    low, high = tensor.detach().aminmax()
    return bool(torch.isfinite(low) & torch.isfinite(high))


def _loadable_form(engine) -> tuple[str, Optional[list[int]], bool, int]:
    """(the converted form this engine loads, the pipeline's stage boundaries, bf16, neuron
    shares)."""
    split = getattr(engine.module, "neuron_split", None)
    neurons = split[1] if split else 1
    if getattr(engine, "pipeline_parallelism", False):
        return "pipeline", [int(p) for p in engine.module.parts], False, neurons
    form = "zero0" if engine.zero_optimization_stage() == 0 else "universal"
    return form, None, engine.bfloat16_enabled(), neurons
