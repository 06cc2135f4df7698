"""DiLoCo's outer state saved on one layout (data-parallel size, ZeRO stage), laid out for another.

Each rank's saved state names where its flat values sit in the model (`segments`, from
MasterWeights.segments): the pieces of every saved rank are joined per parameter and cut again
for this rank's partition.
"""

import glob
import os
from typing import Optional

import torch

STATE_FILE = "diloco_state"  # <tag dir>/diloco_state_<rank>.pt


def check_diloco_state(tag_dir: str) -> list[str]:
    """The DiLoCo state files of a checkpoint that can move to another layout (none: a run
    without DiLoCo); ValueError in one line for a state that does not say where its values sit
    in the model."""
    files = sorted(glob.glob(os.path.join(tag_dir, f"{STATE_FILE}_*.pt")))
    if files and torch.load(files[0], map_location="cpu", weights_only=False,
                               mmap=True).get("segments") is None:
        raise ValueError(f"--resume_from_checkpoint: {tag_dir} holds no DiLoCo state that says "
                         "where its values sit in the model; it resumes only on its own layout")
    return files


def diloco_state_for(tag_dir: str, segments: list, numels: list[int]) -> Optional[dict]:
    """This rank's DiLoCo state (DiLoCo.state_dict's form) for master tensors laid out as
    `segments` (MasterWeights.segments), gathered from the states every rank of another layout
    saved in `tag_dir` (None: it has none): each flat tensor goes through the parameters."""
    saved = [torch.load(f, map_location="cpu", weights_only=False)
             for f in check_diloco_state(tag_dir)]
    if not saved:
        return None

    def moved(tensors_of) -> list[torch.Tensor]:
        """Lay out again the flat tensors tensors_of(state) -> [one per master tensor]."""
        found: dict[str, dict[int, torch.Tensor]] = {}  # name -> {offset in it: piece}
        for state in saved:
            for flat, pieces in zip(tensors_of(state), state["segments"]):
                for name, at, offset, numel in pieces:
                    found.setdefault(name, {})[at] = flat[offset:offset + numel]
        whole = {name: torch.cat([p[k] for k in sorted(p)]) for name, p in found.items()}
        out = [torch.zeros(n) for n in numels]
        for flat, pieces in zip(out, segments):
            for name, at, offset, numel in pieces:
                flat[offset:offset + numel] = whole[name][at:at + numel]
        return out

    def flat_vector(key):  # one vector over every master tensor (delayed mode)
        if saved[0][key] is None or isinstance(saved[0][key], str):
            return saved[0][key]
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
    return dict(first, numels=numels, segments=segments,
                outer_params=moved(lambda s: s["outer_params"]),
                optimizer={"state": state, "param_groups": groups},
                previous=flat_vector("previous"), pending=flat_vector("pending"))
