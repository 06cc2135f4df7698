"""DiLoCo's state in a checkpoint (diloco_state_<rank>.pt), saved by parameter name.

Format 4: the outer step, the mode, the cut and, per fragment, what is not a vector over its
values (the outer optimizer's step and settings, when its exchange in flight lands). Every vector
the fragments own (theta_outer, the outer optimizer's moments, what top-k kept back, the average
in flight and this island's delta in it) is saved as the universal checkpoint saves the model's
weights: by parameter name, {name: [(neuron share, offset in the flattened parameter, values)]}.
A rank loads by its own pieces of the parameters (MasterWeights.segments), from its own file or,
on another layout, from every rank's: the same cut either way, with a sharded parameter's neuron
shares joined and cut again as the model's are (dragon.parallel.neurons). Formats 1 to 3 (flat
vectors over a rank's values) load as format 4.
"""

import copy
import glob
import math
import os
from typing import Optional

import torch

from dragon.diloco.exchange import FinishedExchange
from dragon.diloco.fragment import Fragment, InFlight
from dragon.diloco.fragment_cut import RUNS, fragment_ids
from dragon.parallel.neurons import SHARDED, join_shares, share_of

STATE_FILE = "diloco_state"  # <tag dir>/diloco_state_<rank>.pt
STATE_VERSION = 4
NAMED = "named"  # in a fragment's in-flight state: its vector is saved by name


def of_outer_loop(loop) -> dict:
    """The state of a dragon.diloco.outer.DiLoCo (its exchanges in flight waited for)."""
    return _by_name({
        "outer_step": loop.outer_step, "mode": loop.mode, "numels": loop.numels,
        "fragments": loop.F, "cut": loop.cut, "segments": _segments(loop.weights, loop.numels),
        "neuron_share": getattr(loop.weights, "neuron_share", lambda: (0, 1))(),
        "fragment": [_of_fragment(f) for f in loop.fragments],
        "peak_bytes": loop.runtime.report.peak_bytes,
        "pace": None if loop.pace is None else loop.pace.state_dict(),  # unequal islands
    }, loop.fragments[0].ids)


def load_outer_loop(loop, state: dict) -> None:
    """Load a DiLoCo's state: this rank's own (of_outer_loop's), or every rank's of another
    layout joined by joined_state."""
    weights = loop.weights
    state = current(state, _shapes(weights, loop.numels), _segments(weights, loop.numels))
    check_fits(state, loop.F, loop.mode)
    if loop.F > 1 and state["cut"] != loop.cut:  # saved before the cut was interleaved
        loop.cut = state["cut"]
        ids = fragment_ids(weights.segments(), weights.shapes(), loop.numels, loop.F, loop.cut)
        for fragment in loop.fragments:
            fragment.ids = ids
    share = getattr(weights, "neuron_share", lambda: (0, 1))()
    cut = _Cut(state, _segments(weights, loop.numels), loop.numels, share,
               getattr(weights, "config", None))
    vectors = {key: cut.flat(pieces) for key, pieces in state[NAMED].items()}
    for fragment, rest in zip(loop.fragments, state["fragment"]):
        load_fragment(fragment, _with_vectors(rest, {k: fragment.of(v) for k, v in
                                                     vectors.items()}))
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


def _vectors_and_rest(fragment: dict) -> tuple[dict, dict]:
    """(the vectors over its values by key, the rest) of a fragment's state (_of_fragment's)."""
    numel, optimizer = fragment["outer"].numel(), dict(fragment["optimizer"])
    state = optimizer["state"].get(0, {})
    vectors = {"optimizer." + k: v for k, v in state.items()
               if torch.is_tensor(v) and v.numel() == numel}
    if optimizer["state"]:
        optimizer["state"] = {0: {k: v for k, v in state.items() if "optimizer." + k not in
                                  vectors}}
    vectors.update(outer=fragment["outer"], residual=fragment["residual"])
    flight = fragment["in_flight"]
    if flight is not None:
        flight = dict(flight)
        for key in ("average", "delta"):
            if torch.is_tensor(flight[key]):
                vectors[key], flight[key] = flight[key], NAMED
    return ({k: v for k, v in vectors.items() if v is not None},
            {"optimizer": optimizer, "in_flight": flight})


def _with_vectors(rest: dict, vectors: dict) -> dict:
    """A fragment's state (_of_fragment's) from its rest and its vectors by key."""
    optimizer = dict(rest["optimizer"])
    if optimizer["state"]:
        optimizer["state"] = {0: dict(optimizer["state"][0], **{
            k.removeprefix("optimizer."): v for k, v in vectors.items()
            if k.startswith("optimizer.")})}
    flight = rest["in_flight"]
    if flight is not None:
        flight = dict(flight, **{k: vectors[k] for k in ("average", "delta")
                                 if flight[k] == NAMED})
    return dict(rest, optimizer=optimizer, outer=vectors["outer"], in_flight=flight,
                residual=vectors.get("residual"))


def _by_name(state: dict, ids: Optional[torch.Tensor]) -> dict:
    """Format 3's `state` (every fragment's vectors flat over the rank's values; `ids`: each
    value's fragment, None: one fragment) in format 4."""
    split = [_vectors_and_rest(f) for f in state["fragment"]]
    numels, segments, j = state["numels"], state["segments"], state["neuron_share"][0]
    named = {}
    for key in sorted({k for vectors, _ in split for k in vectors}):
        flat = torch.zeros(sum(numels))
        for f, (vectors, _) in enumerate(split):
            if key in vectors:
                values = vectors[key].to("cpu", torch.float32).reshape(-1)
                flat = values if ids is None else flat.index_put_((ids == f,), values)
        named[key] = {}
        for pieces, tensor in zip(segments, flat.split(numels)):
            for name, at, offset, count in pieces:
                named[key].setdefault(name, []).append((j, at, tensor[offset:offset + count]))
    kept = {k: v for k, v in state.items() if k not in ("numels", "segments", "fragment")}
    return dict(kept, version=STATE_VERSION, fragment=[r for _, r in split], **{NAMED: named})


class _Cut:
    """This rank's values (of master tensors `numels` laid out as `segments`, of neuron share
    `share` = (index, K) of a BDH `config`) out of vectors saved by name."""

    def __init__(self, state: dict, segments: list, numels: list[int],
                 share: tuple[int, int], config):
        self.segments, self.numels, self.share, self.config = segments, numels, share, config
        self.saved_k = state["neuron_share"][1]

    def flat(self, named: dict) -> torch.Tensor:
        out, base = torch.zeros(sum(self.numels)), 0
        for pieces, numel in zip(self.segments, self.numels):
            for name, at, offset, count in pieces:
                out[base + offset:base + offset + count] = self._values(named, name, at, count)
            base += numel
        return out

    def _values(self, named: dict, name: str, at: int, count: int) -> torch.Tensor:
        pieces = named.get(name, [])
        if name not in SHARDED or self.share[1] * self.saved_k == 1:
            pieces = [p for p in pieces if p[0] == min(p[0] for p in pieces)]
        elif self.saved_k == self.share[1]:
            pieces = [p for p in pieces if p[0] == self.share[0]]
        else:  # another count of shares: join them and cut this rank's share
            pieces = [(0, 0, self._share(name, pieces))]
        values, end = [], at  # replicas of the same values are read once
        for _, start, t in sorted(pieces, key=lambda p: p[1]):
            if start <= end < min(start + t.numel(), at + count):
                values.append(t[end - start:min(start + t.numel(), at + count) - start])
                end = start + (end - start) + values[-1].numel()
        if end != at + count:
            raise ValueError(f"DiLoCo state holds {end - at} of the {count} values of {name} "
                             f"from offset {at} on; resume on the model it was saved with")
        return torch.cat(values) if values else torch.zeros(0)

    def _share(self, name: str, pieces: list) -> torch.Tensor:
        c = self.config
        whole = torch.empty((c.n_head * c.n_neurons, c.n_embd) if name.endswith("decoder") else
                            (c.n_head, c.n_embd, c.n_neurons), device="meta")
        shares = []
        for j in range(self.saved_k):
            shape = share_of(name, whole, c, j, self.saved_k).shape
            values = torch.zeros(math.prod(shape))
            for _, at, piece in (p for p in pieces if p[0] == j):
                values[at:at + piece.numel()] = piece
            shares.append({name: values.view(shape)})
        return share_of(name, join_shares(shares, c)[name], c, *self.share).reshape(-1)


def _segments(weights, numels: list[int]) -> list:
    """Where the master tensors' values sit in the model (weights without names: one piece of
    a parameter named by its index per tensor)."""
    if hasattr(weights, "segments"):
        return weights.segments()
    return [[(str(i), 0, 0, n)] for i, n in enumerate(numels)]


def _shapes(weights, numels: list[int]) -> dict:
    return weights.shapes() if hasattr(weights, "shapes") else {
        str(i): (n,) for i, n in enumerate(numels)}


def check_fits(state: dict, fragments: int, mode: str) -> None:
    """ValueError in one line unless the saved `state` fits an outer loop of `fragments`
    fragments in `mode`."""
    saved = (state.get("fragments", 1), state["mode"])
    if saved != (fragments, mode):
        raise ValueError(
            f"DiLoCo state of --diloco_fragments {saved[0]} --diloco_mode {saved[1]} does not "
            f"fit --diloco_fragments {fragments} --diloco_mode {mode}; resume with "
            f"--diloco_fragments {saved[0]} --diloco_mode {saved[1]}")


def current(state: dict, shapes: dict, segments: list) -> dict:
    """`state` in format 4 (`shapes` and `segments`: this rank's, for a state of formats 1 to 3
    saved on this layout without them); ValueError in one line for a format newer than this
    dragon's."""
    version = state.get("version", 1)  # 1: saved before the field existed (format 2's keys)
    if version > STATE_VERSION:
        raise ValueError(f"DiLoCo state of format {version}: this dragon reads formats up to "
                         f"{STATE_VERSION}; resume with the dragon that saved it")
    if version == STATE_VERSION:
        return state
    if version < 3:
        state = _format_3(state, shapes)
    state = dict(state, segments=state["segments"] or segments,
                 neuron_share=state.get("neuron_share") or (0, 1))
    ids = None if state["fragments"] == 1 else fragment_ids(
        state["segments"], shapes, state["numels"], state["fragments"], state["cut"])
    return _by_name(state, ids)


def _format_3(state: dict, shapes: dict) -> dict:
    """Format 1 or 2's `state` (plain DiLoCo's tensors, or streaming DiLoCo's fragments side by
    side) in format 3."""
    if state.get("fragments", 1) == 1:
        fragments = [_plain_fragment(state)]
    else:
        ids = fragment_ids(state["segments"], shapes, state["numels"], state["fragments"],
                           state.get("cut", RUNS))
        fragments = [_streaming_fragment(state, f, ids == f) for f in range(state["fragments"])]
    kept = ("outer_step", "mode", "numels", "segments", "neuron_share")
    return dict({k: state.get(k) for k in kept}, version=3, fragment=fragments,
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
    if first is not None and NAMED not in first and (
            first.get("segments") is None or (neurons > 1 and "neuron_share" not in first)):
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


def joined_state(tag_dir: str, weights, numels: list[int]) -> Optional[dict]:
    """The states every rank of another layout saved in `tag_dir` as one, for master tensors
    of `numels` values laid out as `weights` (MasterWeights) lay theirs (None: it has none)."""
    shapes, segments = _shapes(weights, numels), _segments(weights, numels)
    saved = [current(s, shapes, segments) for s in saved_states(tag_dir)]
    if not saved:
        return None
    named: dict = {}
    for state in saved:
        for key, by_name in state[NAMED].items():
            for name, pieces in by_name.items():
                named.setdefault(key, {}).setdefault(name, []).extend(pieces)
    return dict(saved[0], **{NAMED: named})
