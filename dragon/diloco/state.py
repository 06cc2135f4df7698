"""DiLoCo's state in a checkpoint: what each rank saves and loads (OuterState, a part of
dragon.diloco.outer.DiLoCo), and the re-layout of a state saved on one partition of the weights
(data-parallel size, ZeRO stage) for another.

Each rank's saved state names where its flat values sit in the model (`segments`, from
MasterWeights.segments): the pieces of every saved rank are joined per parameter and cut again
for this rank's partition.
"""

import functools
import glob
import math
import os
from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed as dist

from dragon.diloco.exchange import FinishedExchange
from dragon.parallel.neurons import SHARDED, share_of

STATE_FILE = "diloco_state"  # <tag dir>/diloco_state_<rank>.pt


class OuterState:
    """DiLoCo's save and resume: theta_outer, the outer optimizer, the outer step and (delayed)
    what is in flight."""

    def state_dict(self) -> dict:
        """theta_outer, the outer optimizer, the outer step and (delayed) this island's last
        pseudo-gradient and the average in flight (waited for here: the save point is the same on
        every island)."""
        try:
            pending = self.pending.result().clone() if self.pending is not None else None
        except RuntimeError:  # elastic: an island died during it; the next outer step redoes it
            pending = "lost"
        return {
            "outer_step": self.outer_step,
            "mode": self.mode,
            "numels": self.numels,
            # the partition, for dragon.checkpoint.reshape
            "segments": getattr(self.weights, "segments", lambda: None)(),
            "neuron_share": getattr(self.weights, "neuron_share", lambda: (0, 1))(),
            "outer_params": [p.detach().cpu().clone() for p in self.outer_params],
            "optimizer": self.optimizer.state_dict(),
            "previous": None if self.previous is None else self.previous.clone(),
            "residual": None if self.residual is None else self.residual.clone(),
            "pending": pending,
            "previous_share": self.previous_share,
            "contributed": self.contributed,
            "peak_bytes": self.peak_bytes,
        }

    def load_state_dict(self, state: dict) -> None:
        """This rank's state as it saved it; every island must resume the same outer step."""
        self.check_same_step(state["outer_step"], "outer steps")
        self._load(state)

    def resume_elsewhere(self, saved) -> None:
        """Resume from a checkpoint that holds no state of this rank as it is now
        (dragon.checkpoint.checkpointer.Saved): one saved on another partition of the weights
        (laid out again for this one), island 0's (a new island: no share of its own in the
        average in flight), or one of a run without DiLoCo (the outer loop starts afresh)."""
        self.check_same_step(saved.step)
        if saved.relaid:
            state = self._relaid_state(saved.tag_dir)
        else:
            state = saved.rank_file(STATE_FILE)
        if state is None:
            self.restart()
            return
        self._load(state)
        if saved.borrowed:
            self.forget_own_share()

    def _relaid_state(self, tag_dir: str) -> Optional[dict]:
        """This rank's state from one saved on another partition of the weights (None: none)."""
        return diloco_state_for(tag_dir, self.weights, self.numels)

    def _load(self, state: dict) -> None:
        if state.get("fragments", 1) != 1:
            raise ValueError(f"DiLoCo state of {state['fragments']} fragments does not fit "
                             f"--diloco_fragments 1; resume with --diloco_fragments "
                             f"{state['fragments']}")
        if state["mode"] != self.mode:
            raise ValueError(f"DiLoCo state of --diloco_mode {state['mode']} does not fit "
                             f"--diloco_mode {self.mode}; resume with --diloco_mode "
                             f"{state['mode']}")
        if state["numels"] != self.numels:
            raise ValueError(
                f"DiLoCo state of {len(state['numels'])} tensors does not fit this layout's "
                f"{len(self.numels)}; resume with the model, ZeRO stage and island size it was "
                "saved with"
            )
        with torch.no_grad():
            for p, saved in zip(self.outer_params, state["outer_params"]):
                p.copy_(saved)
            if self.previous is not None:
                self.previous.copy_(state["previous"])
            if self.residual is not None and state.get("residual") is not None:
                self.residual.copy_(state["residual"])
            elif self.residual is not None:  # a run without top-k until now
                self.residual.zero_()
        self.optimizer.load_state_dict(state["optimizer"])
        self.outer_step = state["outer_step"]
        pending = state["pending"]
        self.pending = None if pending is None else FinishedExchange(
            None if isinstance(pending, str) else pending)
        self.previous_share = state.get("previous_share", self.islands)
        self.contributed = state.get("contributed", True)
        self.peak_bytes = state.get("peak_bytes", 0)

    def forget_own_share(self) -> None:
        """A new island resumed from island 0's state has no pseudo-gradient of its own in the
        average in flight, nor anything of its own held back (top-k)."""
        for vector in (self.previous, self.residual):
            if vector is not None:
                vector.zero_()
        self.contributed = False

    def restart(self) -> None:
        """Start the outer loop afresh from the current weights (a checkpoint saved without DiLoCo).
        """
        self._adopt_island0_weights()
        masters = self.weights.tensors()
        with torch.no_grad():
            for p, m in zip(self.outer_params, masters):
                p.copy_(m)
            for vector in (self.previous, self.residual):
                if vector is not None:
                    vector.zero_()
        self.optimizer = self._make_optimizer(self.outer_params)
        self.pending, self.outer_step = None, 0

    def check_same_step(self, step: int, what: str = "steps") -> None:
        """Raise unless every island resumed at the same step (a collective across islands)."""
        if self.group is None:
            return
        t = torch.tensor([step, -step], dtype=torch.float64)
        self.group.allreduce([t], dist.ReduceOp.MAX).wait()
        if t[0] != -t[1]:
            raise RuntimeError(
                f"islands resumed from different {what} ({int(-t[1])} to {int(t[0])}); "
                "resume every island from the same checkpoint step"
            )


def _state_files(tag_dir: str) -> tuple[list[str], Optional[dict]]:
    """A checkpoint's DiLoCo state files, and the first one's state read lazily (None: none)."""
    files = sorted(glob.glob(os.path.join(tag_dir, f"{STATE_FILE}_*.pt")))
    first = (torch.load(files[0], map_location="cpu", weights_only=False, mmap=True)
             if files else None)
    return files, first


def check_diloco_state(tag_dir: str, neurons: int = 1) -> list[str]:
    """The DiLoCo state files of a checkpoint (saved by `neurons` shares) that can move to
    another layout (none: a run without DiLoCo); ValueError in one line for a state that does
    not say where its values sit in the model."""
    files, first = _state_files(tag_dir)
    if first is not None and (first.get("segments") is None or
                              (neurons > 1 and "neuron_share" not in first)):
        raise ValueError(f"--resume_from_checkpoint: {tag_dir} holds no DiLoCo state that says "
                         "where its values sit in the model; it resumes only on its own layout")
    return files


def saved_fragments_and_mode(tag_dir: str) -> Optional[tuple[int, str]]:
    """(--diloco_fragments, --diloco_mode) of the run that saved `tag_dir` (None: it holds no
    DiLoCo state)."""
    first = _state_files(tag_dir)[1]
    return None if first is None else (first.get("fragments", 1), first["mode"])


def saved_states(tag_dir: str) -> list[dict]:
    """Every rank's DiLoCo state saved in `tag_dir`, each saying where its values sit."""
    return [torch.load(f, map_location="cpu", weights_only=False)
            for f in check_diloco_state(tag_dir)]


def relay(saved: list[dict], segments: list, numels: list[int], tensors_of,
          share: tuple[int, int] = (0, 1), config=None) -> list[torch.Tensor]:
    """Flat tensors that the ranks of another layout saved (tensors_of(state) -> one per master
    tensor of that rank) laid out again for master tensors `segments` of `numels` values: each
    flat tensor goes through the whole model's parameters. A state saved by neuron share j of K
    (its "neuron_share") places its values of a sharded parameter through share j's cut, and
    this rank (`share`, of a BDH `config`) takes its own share's."""
    found: dict[str, dict[int, torch.Tensor]] = {}  # name -> {offset in it: piece}
    whole: dict[str, torch.Tensor] = {}  # sharded names, placed in the whole parameter
    bdh = hasattr(config, "n_neurons")  # a baseline's config has no neurons to share
    dims = (config.n_head, config.n_embd, config.n_neurons) if bdh else None
    for state in saved:
        j, k = state.get("neuron_share", (0, 1))
        for flat, pieces in zip(tensors_of(state), state["segments"]):
            for name, at, offset, numel in pieces:
                piece = flat[offset:offset + numel]
                if k > 1 and name in SHARDED:
                    if name not in whole:
                        whole[name] = torch.zeros(math.prod(dims))
                    whole[name][_share_index(name, dims, j, k)[at:at + numel]] = piece
                else:
                    found.setdefault(name, {})[at] = piece
    whole.update((name, torch.cat([p[k] for k in sorted(p)])) for name, p in found.items())
    out = [torch.zeros(n) for n in numels]
    for flat, pieces in zip(out, segments):
        for name, at, offset, numel in pieces:
            if share[1] > 1 and name in SHARDED:
                places = _share_index(name, dims, *share)[at:at + numel]
                flat[offset:offset + numel] = whole[name][places]
            else:
                flat[offset:offset + numel] = whole[name][at:at + numel]
    return out


@functools.lru_cache(maxsize=8)
def _share_index(name: str, dims: tuple[int, int, int], index: int, k: int) -> torch.Tensor:
    """Where share `index` of `k` of the sharded parameter `name` of a BDH of (heads, n_embd,
    neurons per head) `dims` sits in the flattened whole one, in the share's flattened order."""
    nh, D, N = dims
    shape = (nh * N, D) if name.endswith("decoder") else (nh, D, N)
    places = torch.arange(nh * D * N).view(shape)
    config = SimpleNamespace(n_head=nh, n_embd=D, n_neurons=N)
    return share_of(name, places, config, index, k).reshape(-1)


def diloco_state_for(tag_dir: str, weights, numels: list[int]) -> Optional[dict]:
    """This rank's DiLoCo state (DiLoCo.state_dict's form) for master tensors laid out as
    `weights` (MasterWeights) lay theirs, gathered from the states every rank of another layout
    saved in `tag_dir` (None: it has none): each flat tensor goes through the parameters."""
    saved = saved_states(tag_dir)
    if not saved:
        return None
    segments, share = weights.segments(), weights.neuron_share()

    def moved(tensors_of) -> list[torch.Tensor]:
        return relay(saved, segments, numels, tensors_of, share, weights.config)

    def flat_vector(key):  # one vector over every master tensor (delayed mode)
        if saved[0].get(key) is None or isinstance(saved[0][key], str):
            return saved[0].get(key)
        return torch.cat(moved(lambda state: state[key].split(state["numels"])))

    first = saved[0]
    optimizer = first["optimizer"]
    keys = [k for k, v in optimizer["state"].get(0, {}).items()
            if torch.is_tensor(v) and v.shape == first["outer_params"][0].shape]
    state = {i: {k: v for k, v in optimizer["state"][0].items() if k not in keys}
             for i in range(len(numels))} if optimizer["state"] else {}
    for key in keys:
        for i, values in enumerate(moved(lambda s: [s["optimizer"]["state"][j][key]
                                                     for j in range(len(s["numels"]))])):
            state[i][key] = values
    groups = [dict(optimizer["param_groups"][0], params=list(range(len(numels))))]
    return dict(first, numels=numels, segments=segments, neuron_share=share,
                outer_params=moved(lambda s: s["outer_params"]),
                optimizer={"state": state, "param_groups": groups},
                previous=flat_vector("previous"), pending=flat_vector("pending"),
                residual=flat_vector("residual"))
