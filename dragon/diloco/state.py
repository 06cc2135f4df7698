"""DiLoCo's state in a checkpoint (diloco_state_<rank>.pt), saved by parameter name.

Format 4: the outer step, the mode, the cut and, per fragment, what is not a vector over its
values (the outer optimizer's step and settings, when its exchange in flight lands). Every vector
the fragments own (theta_outer, the outer optimizer's moments, what top-k kept back, the average
in flight and this island's delta in it) is saved as the universal checkpoint saves the model's
weights: by parameter name (dragon.parallel.named_values), so that a rank loads its values from
its own file or, on another layout, from every rank's by the same cut. Formats 1 to 3 (flat
vectors over a rank's values) load as format 4. With several fragments, a vector that only some
hold (an average in flight) is saved over all values, 0 where it has none.
"""

import copy
import glob
import os
from typing import Optional

import torch

from dragon.diloco.fragment import Fragment, InFlight
from dragon.diloco.fragment_cut import RUNS, fragment_ids
from dragon.parallel.named_values import RankLayout, merged
from dragon.wire.exchange import FinishedExchange

STATE_FILE = "diloco_state"  # <tag dir>/diloco_state_<rank>.pt
STATE_VERSION = 4
NAMED = "named"  # the state's vectors by name; in a fragment's rest: this entry is one of them


def of_outer_loop(loop) -> dict:
    """The state of a dragon.diloco.outer.DiLoCo (its exchanges in flight waited for)."""
    return _by_name({
        "outer_step": loop.outer_step, "mode": loop.mode, "fragments": loop.F, "cut": loop.cut,
        "fragment": [_of_fragment(f) for f in loop.fragments],
        "peak_bytes": loop.runtime.report.peak_bytes,
        "pace": None if loop.pace is None else loop.pace.state_dict(),  # unequal islands
    }, loop.fragments[0].ids, RankLayout.of(loop.weights, loop.numels))


def load_outer_loop(loop, state: dict) -> None:
    """Load a DiLoCo's state: this rank's own (of_outer_loop's, or of formats 1 to 3), or every
    rank's of another layout merged by joined_state."""
    layout = RankLayout.of(loop.weights, loop.numels)
    check_fits(state, loop.F, loop.mode)
    state = current(state, layout)
    if loop.F > 1 and state["cut"] != loop.cut:  # saved before the cut was interleaved
        loop.cut_as(state["cut"])
    vectors = {key: layout.flat(pieces, state["neuron_share"][1], f"{STATE_FILE}'s {key}")
               for key, pieces in state[NAMED].items()}
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
    """(the vectors over its values by key, the rest, NAMED in their places) of a fragment's
    state (_of_fragment's)."""
    vectors = {"outer": fragment["outer"], "residual": fragment["residual"]}
    optimizer, flight = dict(fragment["optimizer"]), fragment["in_flight"]
    if optimizer["state"]:
        state = dict(optimizer["state"][0])  # moments over the values, not the step
        for k, v in state.items():
            if torch.is_tensor(v) and v.shape == fragment["outer"].shape:
                vectors["optimizer." + k], state[k] = v, NAMED
        optimizer["state"] = {0: state}
    if flight is not None:
        flight = dict(flight)
        for k in ("average", "delta"):
            if torch.is_tensor(flight[k]):
                vectors[k], flight[k] = flight[k], NAMED
    return ({k: v for k, v in vectors.items() if v is not None},
            {"optimizer": optimizer, "in_flight": flight})


def _with_vectors(rest: dict, vectors: dict) -> dict:
    """A fragment's state (_of_fragment's) from its rest and its vectors by key."""
    def filled(entries: dict, prefix: str = "") -> dict:
        return {k: vectors[prefix + k] if isinstance(v, str) and v == NAMED else v
                for k, v in entries.items()}

    optimizer, flight = dict(rest["optimizer"]), rest["in_flight"]
    if optimizer["state"]:
        optimizer["state"] = {0: filled(optimizer["state"][0], "optimizer.")}
    return dict(rest, optimizer=optimizer, outer=vectors["outer"],
                residual=vectors.get("residual"), in_flight=flight and filled(flight))


def _by_name(state: dict, ids: Optional[torch.Tensor], layout: RankLayout) -> dict:
    """Format 3's `state` (every fragment's vectors flat over the values of a rank of `layout`;
    `ids`: each value's fragment, None: one fragment) in format 4."""
    split = [_vectors_and_rest(f) for f in state["fragment"]]
    named = {}
    for key in sorted({k for vectors, _ in split for k in vectors}):
        flat = None if ids is None else torch.zeros(sum(layout.numels))  # F > 1: 0 where none
        for f, (vectors, _) in enumerate(split):
            if key in vectors:
                values = vectors[key].to("cpu", torch.float32).reshape(-1)
                flat = values if ids is None else flat.index_put_((ids == f,), values)
        named[key] = layout.by_name(flat)
    kept = {k: v for k, v in state.items() if k not in ("numels", "segments", "fragment")}
    return dict(kept, version=STATE_VERSION, neuron_share=layout.share,
                fragment=[r for _, r in split], **{NAMED: named})


def check_fits(state: dict, fragments: int, mode: str) -> None:
    """ValueError in one line unless the saved `state` fits an outer loop of `fragments`
    fragments in `mode`."""
    saved = (state.get("fragments", 1), state["mode"])
    if saved != (fragments, mode):
        raise ValueError(
            f"DiLoCo state of --diloco_fragments {saved[0]} --diloco_mode {saved[1]} does not "
            f"fit --diloco_fragments {fragments} --diloco_mode {mode}; resume with "
            f"--diloco_fragments {saved[0]} --diloco_mode {saved[1]}")


def current(state: dict, layout: RankLayout) -> dict:
    """`state` in format 4 (`layout`: this rank's, for a state of formats 1 to 3 saved without
    its segments, on this layout); ValueError in one line for a format newer than this
    dragon's."""
    version = state.get("version", 1)  # 1: saved before the field existed (format 2's keys)
    if version > STATE_VERSION:
        raise ValueError(f"DiLoCo state of format {version}: this dragon reads formats up to "
                         f"{STATE_VERSION}; resume with the dragon that saved it")
    if version == STATE_VERSION:
        return state
    saved = RankLayout(state["numels"], state.get("segments") or layout.segments, layout.shapes,
                       tuple(state.get("neuron_share") or (0, 1)))
    if version < 3:
        state = _format_3(state, saved)
    ids = None if state["fragments"] == 1 else fragment_ids(
        saved.segments, saved.shapes, saved.numels, state["fragments"], state["cut"])
    return _by_name(state, ids, saved)


def _format_3(state: dict, layout: RankLayout) -> dict:
    """Format 1 or 2's `state` (plain DiLoCo's tensors, or streaming DiLoCo's fragments side by
    side) in format 3."""
    if state.get("fragments", 1) == 1:
        fragments = [_plain_fragment(state)]
    else:
        ids = fragment_ids(layout.segments, layout.shapes, layout.numels, state["fragments"],
                           state.get("cut", RUNS))
        fragments = [_streaming_fragment(state, f, ids == f) for f in range(state["fragments"])]
    kept = ("outer_step", "mode")
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
    return [torch.load(f, map_location="cpu", weights_only=False, mmap=True)
            for f in check_diloco_state(tag_dir)]


def joined_state(tag_dir: str, weights, numels: list[int]) -> Optional[dict]:
    """The states every rank of another layout saved in `tag_dir` merged into one, which
    load_outer_loop cuts this rank's values from (None: it has none; `weights` and `numels`:
    this rank's, for states of formats 1 to 3). An average in flight that one rank lost is
    lost to all (its landing redoes it)."""
    layout = RankLayout.of(weights, numels)
    saved = [current(s, layout) for s in saved_states(tag_dir)]
    if not saved:
        return None
    named = {key: merged([state[NAMED][key] for state in saved if key in state[NAMED]])
             for key in {k for state in saved for k in state[NAMED]}}
    lost = [any(_lost(state["fragment"][f]) for state in saved)
            for f in range(len(saved[0]["fragment"]))]
    fragments = [dict(rest, in_flight=dict(rest["in_flight"], average="lost")) if gone else rest
                 for rest, gone in zip(saved[0]["fragment"], lost)]
    return dict(saved[0], fragment=fragments, **{NAMED: named})


def _lost(rest: dict) -> bool:
    return rest["in_flight"] is not None and rest["in_flight"]["average"] == "lost"
