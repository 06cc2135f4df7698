"""DiLoCo's state in a checkpoint: the checks every outer loop's state goes through, and the
re-layout of a state saved on one partition of the weights (data-parallel size, ZeRO stage) for
another.

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

from dragon.diloco.fragment_cut import RUNS, fragment_ids
from dragon.parallel.neurons import SHARDED, share_of

STATE_FILE = "diloco_state"  # <tag dir>/diloco_state_<rank>.pt
# the format of a saved state; 1: saved before the field existed (the same keys), which loads
STATE_VERSION = 2


def check_fits(state: dict, fragments: int, mode: str, numels: list[int]) -> None:
    """ValueError in one line unless this rank's saved `state` fits an outer loop of `fragments`
    fragments in `mode` over master tensors of `numels` values."""
    version = state.get("version", 1)
    if version > STATE_VERSION:
        raise ValueError(f"DiLoCo state of format {version}: this dragon reads formats up to "
                         f"{STATE_VERSION}; resume with the dragon that saved it")
    saved = (state.get("fragments", 1), state["mode"], state["numels"])
    if saved != (fragments, mode, numels):
        raise ValueError(
            f"DiLoCo state of --diloco_fragments {saved[0]} --diloco_mode {saved[1]} over "
            f"{len(saved[2])} tensors does not fit --diloco_fragments {fragments} --diloco_mode "
            f"{mode} over {len(numels)} on this layout; resume with --diloco_fragments "
            f"{saved[0]} --diloco_mode {saved[1]} on the model, ZeRO stage and island size it was "
            "saved with")


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


def laid_out_for(saved: list[dict], segments: list, numels: list[int], tensors_of,
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
        return laid_out_for(saved, segments, numels, tensors_of, share, weights.config)

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


def fragment_state_for(tag_dir: str, weights, numels: list[int], fragments: int
                       ) -> Optional[dict]:
    """This rank's state from the fragment states the ranks of another partition of the
    weights saved: every fragment's vectors put back in place over each saved rank's values,
    laid out again for this rank's (laid_out_for), and cut by this rank's ids."""
    saved = saved_states(tag_dir)
    if not saved:
        return None
    shapes, first = weights.shapes(), saved[0]
    cut = first.get("cut", RUNS)
    ids = fragment_ids(weights.segments(), shapes, numels, fragments, cut)
    old = [fragment_ids(s["segments"], shapes, s["numels"], fragments, cut) for s in saved]
    at = {id(s): i for i, s in enumerate(saved)}

    def moved(vectors_of) -> list[Optional[torch.Tensor]]:
        """Per fragment, vectors_of(state) (F masked vectors, None where a fragment has
        none) laid out for this rank."""
        def placed(state: dict) -> list[torch.Tensor]:
            flat = torch.zeros(sum(state["numels"]))
            for f, vector in enumerate(vectors_of(state)):
                if vector is not None:
                    flat[old[at[id(state)]] == f] = vector.float()
            return list(flat.split(state["numels"]))
        whole = torch.cat(laid_out_for(saved, weights.segments(), numels, placed,
                                       weights.neuron_share(), weights.config))
        present = [v is not None for v in vectors_of(first)]
        return [whole[ids == f] if present[f] else None for f in range(fragments)]

    optimizers = [dict(o) for o in first["optimizers"]]  # a fragment not stepped yet: none
    buffers = moved(lambda s: [o["state"].get(0, {}).get("momentum_buffer")
                               for o in s["optimizers"]])
    for optimizer, buffer in zip(optimizers, buffers):
        if buffer is not None:
            optimizer["state"] = {0: dict(optimizer["state"][0], momentum_buffer=buffer)}

    def flights(i: int):  # item i of each fragment's saved flight, where it is a vector
        return lambda s: [_vector(s["in_flight"].get(f, ()), i) for f in range(fragments)]

    landing, sent_deltas = moved(flights(0)), moved(flights(3))
    residual = None
    if first.get("residual") is not None:
        residual = torch.cat(laid_out_for(saved, weights.segments(), numels,
                                          lambda s: list(s["residual"].split(s["numels"])),
                                          weights.neuron_share(), weights.config))
    return dict(first, numels=numels, segments=weights.segments(),
                neuron_share=weights.neuron_share(), optimizers=optimizers,
                outer_params=moved(lambda s: s["outer_params"]), residual=residual,
                in_flight={f: ("lost" if isinstance(v[0], str) else landing[f], *v[1:3],
                               sent_deltas[f], *v[4:]) for f, v in first["in_flight"].items()})


def _vector(saved: tuple, i: int) -> Optional[torch.Tensor]:
    return saved[i] if len(saved) > i and torch.is_tensor(saved[i]) else None
