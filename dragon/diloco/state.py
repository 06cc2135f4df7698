"""DiLoCo's state in a checkpoint (diloco_state_<rank>.pt), and its re-layout for another
partition of the weights (data-parallel size, ZeRO stage, neuron shares).

Format 3: the outer step, the mode, the partition (`segments`: where this rank's flat values sit
in the model's parameters, by name; `neuron_share`) and, per fragment, theta_outer, the outer
optimizer's state, what top-k kept back and the exchange in flight, each a vector over the
fragment's values. A re-layout puts every saved rank's vectors back in place in the model's
parameters by name and cuts them again for this rank, as the model's weights are. Formats 1
and 2 (plain DiLoCo's tensors, or streaming DiLoCo's fragments side by side) load as format 3.
"""

import copy
import functools
import glob
import math
import os
from types import SimpleNamespace
from typing import Callable, Optional

import torch

from dragon.diloco.exchange import FinishedExchange
from dragon.diloco.fragment import Fragment, InFlight
from dragon.diloco.fragment_cut import RUNS, fragment_ids
from dragon.parallel.neurons import SHARDED, share_of

STATE_FILE = "diloco_state"  # <tag dir>/diloco_state_<rank>.pt
STATE_VERSION = 3


def of_outer_loop(loop) -> dict:
    """The state of a dragon.diloco.outer.DiLoCo (its exchanges in flight waited for)."""
    weights = loop.weights
    return {
        "version": STATE_VERSION, "outer_step": loop.outer_step, "mode": loop.mode,
        "numels": loop.numels, "fragments": loop.F, "cut": loop.cut,
        "segments": getattr(weights, "segments", lambda: None)(),
        "neuron_share": getattr(weights, "neuron_share", lambda: (0, 1))(),
        "fragment": [_of_fragment(f) for f in loop.fragments],
        "peak_bytes": loop.runtime.report.peak_bytes,
        "pace": None if loop.pace is None else loop.pace.state_dict(),  # unequal islands
    }


def load_outer_loop(loop, state: dict) -> None:
    """Load a DiLoCo's state (of_outer_loop's, saved on this rank's layout or laid out for it)."""
    state = current(state, getattr(loop.weights, "shapes", dict)())
    check_fits(state, loop.F, loop.mode, loop.numels)
    if loop.F > 1 and state["cut"] != loop.cut:  # saved before the cut was interleaved
        loop.cut = state["cut"]
        ids = fragment_ids(loop.weights.segments(), loop.weights.shapes(), loop.numels, loop.F,
                           loop.cut)
        for fragment in loop.fragments:
            fragment.ids = ids
    for fragment, saved in zip(loop.fragments, state["fragment"]):
        load_fragment(fragment, saved)
    loop.outer_step = state["outer_step"]
    if loop.pace is not None:
        loop.pace.load_state_dict(state.get("pace"))  # absent: saved with equal islands
    loop.runtime.report.peak_bytes = state["peak_bytes"]


def _of_fragment(fragment: Fragment) -> dict:
    flight, x = None, fragment.in_flight
    if x is not None:
        try:
            average = x.exchange.result().clone()
        except RuntimeError:  # elastic: an island died during it; its landing redoes it
            average = "lost"
        flight = {"average": average, "lands_at": x.lands_at, "synced_at": x.synced_at,
                  "delta": None if x.delta is None else x.delta.clone(),
                  "contributed": x.contributed, "share": x.share}
    return {"outer": fragment.outer.detach().cpu().clone(),
            "optimizer": copy.deepcopy(fragment.optimizer.state_dict()),  # not the live state
            "residual": None if fragment.residual is None else fragment.residual.clone(),
            "in_flight": flight}


def load_fragment(fragment: Fragment, saved: dict) -> None:
    """A fragment's saved state (_of_fragment) into `fragment`."""
    with torch.no_grad():
        fragment.outer.copy_(saved["outer"].view_as(fragment.outer))
        if fragment.residual is not None and saved["residual"] is not None:
            fragment.residual.copy_(saved["residual"])
        elif fragment.residual is not None:  # a run without top-k until now
            fragment.residual.zero_()
    fragment.optimizer.load_state_dict(copy.deepcopy(saved["optimizer"]))  # torch aliases it
    x = saved["in_flight"]
    fragment.in_flight = None if x is None else InFlight(
        FinishedExchange(None if isinstance(x["average"], str) else x["average"]),
        x["lands_at"], x["synced_at"], x["delta"], x["contributed"], x["share"])


def check_fits(state: dict, fragments: int, mode: str, numels: list[int]) -> None:
    """ValueError in one line unless this rank's saved `state` fits an outer loop of `fragments`
    fragments in `mode` over master tensors of `numels` values."""
    saved = (state.get("fragments", 1), state["mode"], state["numels"])
    if saved != (fragments, mode, numels):
        raise ValueError(
            f"DiLoCo state of --diloco_fragments {saved[0]} --diloco_mode {saved[1]} over "
            f"{len(saved[2])} tensors does not fit --diloco_fragments {fragments} --diloco_mode "
            f"{mode} over {len(numels)} on this layout; resume with --diloco_fragments "
            f"{saved[0]} --diloco_mode {saved[1]} on the model, ZeRO stage and island size it was "
            "saved with")


def current(state: dict, shapes: dict) -> dict:
    """`state` in format 3 (`shapes`: the model's parameter shapes, for streaming DiLoCo's cut);
    ValueError in one line for a format newer than this dragon's."""
    version = state.get("version", 1)  # 1: saved before the field existed (format 2's keys)
    if version > STATE_VERSION:
        raise ValueError(f"DiLoCo state of format {version}: this dragon reads formats up to "
                         f"{STATE_VERSION}; resume with the dragon that saved it")
    if version == STATE_VERSION:
        return state
    if state.get("fragments", 1) == 1:
        fragments = [_plain_fragment(state)]
    else:
        ids = fragment_ids(state["segments"], shapes, state["numels"], state["fragments"],
                           state.get("cut", RUNS))
        fragments = [_streaming_fragment(state, f, ids == f) for f in range(state["fragments"])]
    kept = ("outer_step", "mode", "numels", "segments", "neuron_share")
    return dict({k: state.get(k) for k in kept}, version=STATE_VERSION, fragment=fragments,
                cut=state.get("cut", RUNS), fragments=state.get("fragments", 1),
                peak_bytes=state.get("peak_bytes", 0), pace=None)


def _plain_fragment(state: dict) -> dict:
    """Format 2's plain DiLoCo: one tensor per master tensor, and delayed mode's share and
    average in flight."""
    sizes = [p.numel() for p in state["outer_params"]]
    optimizer = state["optimizer"]
    one = {k: (torch.cat([optimizer["state"][i][k].reshape(-1) for i in range(len(sizes))])
               if torch.is_tensor(v) and v.numel() == sizes[0] else v)
           for k, v in optimizer["state"].get(0, {}).items()}
    flight = None
    if state.get("pending") is not None:
        flight = {"average": state["pending"], "lands_at": None, "synced_at": 0,
                  "delta": state["previous"], "contributed": state.get("contributed", True),
                  "share": state.get("previous_share", 0)}
    return {"outer": torch.cat([p.reshape(-1) for p in state["outer_params"]]),
            "optimizer": {"state": {0: one} if one else {},
                          "param_groups": [dict(optimizer["param_groups"][0], params=[0])]},
            "residual": state.get("residual"), "in_flight": flight}


def _streaming_fragment(state: dict, f: int, mask: torch.Tensor) -> dict:
    """Format 2's fragment f of streaming DiLoCo (its residual cut out of the rank's)."""
    flight = state["in_flight"].get(f)
    if flight is not None:
        average, lands_at, synced_at, *rest = flight
        delta, contributed = (list(rest) + [None, True])[:2]
        flight = {"average": average, "lands_at": lands_at, "synced_at": synced_at,
                  "delta": delta, "contributed": contributed, "share": 0}
    residual = state.get("residual")
    return {"outer": state["outer_params"][f], "optimizer": state["optimizers"][f],
            "residual": None if residual is None else residual[mask], "in_flight": flight}


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


def laid_out_state(tag_dir: str, weights, numels: list[int], fragments: int
                   ) -> Optional[dict]:
    """This rank's state (format 3) for master tensors laid out as `weights` (MasterWeights)
    lay theirs, from the states every rank of another layout saved in `tag_dir` (None: it has
    none): every vector of every fragment put back in place in the model's parameters and cut
    again for this rank."""
    shapes = weights.shapes()
    saved = [current(s, shapes) for s in saved_states(tag_dir)]
    if not saved:
        return None
    first, segments, share = saved[0], weights.segments(), weights.neuron_share()

    def ids_of(segments_: list, numels_: list[int]) -> Optional[torch.Tensor]:
        if fragments == 1:
            return None
        return fragment_ids(segments_, shapes, numels_, fragments, first["cut"])

    ids, old = ids_of(segments, numels), {id(s): ids_of(s["segments"], s["numels"]) for s in saved}

    def moved(vector_of: Callable[[dict], Optional[torch.Tensor]]) -> list:
        """vector_of(a fragment's saved state), of every fragment, laid out for this rank."""
        present = [vector_of(f) is not None for f in first["fragment"]]

        def placed(state: dict) -> list[torch.Tensor]:
            flat, cut = torch.zeros(sum(state["numels"])), old[id(state)]
            for f, fragment in enumerate(state["fragment"]):
                vector = vector_of(fragment)
                if vector is not None and cut is None:
                    flat = vector.float().reshape(-1)
                elif vector is not None:
                    flat[cut == f] = vector.float().reshape(-1)
            return list(flat.split(state["numels"]))

        if not any(present):
            return [None] * fragments
        whole = torch.cat(laid_out_for(saved, segments, numels, placed, share, weights.config))
        return [(whole if ids is None else whole[ids == f]) if present[f] else None
                for f in range(fragments)]

    def optimizer_tensors(fragment: dict) -> dict:
        return {k: v for k, v in fragment["optimizer"]["state"].get(0, {}).items()
                if torch.is_tensor(v) and v.numel() == fragment["outer"].numel()}

    keys = {k for f in first["fragment"] for k in optimizer_tensors(f)}
    moments = {k: moved(lambda f, k=k: optimizer_tensors(f).get(k)) for k in keys}
    flights = {k: moved(lambda f, k=k: _vector(f["in_flight"], k)) for k in ("average", "delta")}
    outer, residual = moved(lambda f: f["outer"]), moved(lambda f: f["residual"])
    vectors = {"outer": outer, "residual": residual, "moments": moments, "flights": flights}
    laid = [_with_vectors(fragment, f, **vectors) for f, fragment in enumerate(first["fragment"])]
    return dict(first, numels=numels, segments=segments, neuron_share=share, fragment=laid)


def _with_vectors(fragment: dict, f: int, outer: list, residual: list, moments: dict,
                  flights: dict) -> dict:
    """Fragment f's saved state (the first saved rank's) with the vectors laid out for this
    rank in place of its own."""
    optimizer = dict(fragment["optimizer"])
    if optimizer["state"]:
        optimizer["state"] = {0: dict(optimizer["state"][0], **{
            k: v[f] for k, v in moments.items() if v[f] is not None})}
    flight = fragment["in_flight"]
    if flight is not None:
        flight = dict(flight, delta=flights["delta"][f], average=(
            flight["average"] if isinstance(flight["average"], str) else flights["average"][f]))
    return dict(fragment, outer=outer[f], residual=residual[f], optimizer=optimizer,
                in_flight=flight)


def _vector(flight: Optional[dict], key: str) -> Optional[torch.Tensor]:
    value = None if flight is None else flight[key]
    return value if torch.is_tensor(value) else None
