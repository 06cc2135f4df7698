"""Which checkpoints a directory holds, which of them are complete (their save finished on every
rank: a completion marker) and whole (every file the marker lists, at its size), and where a
resume starts. dragon.checkpoint.retention writes the markers and prunes by this catalogue.
"""

import json
import os
import re
from typing import Optional

from dragon.checkpoint.verify import damage
from dragon.errors import warn

MARKER = "dragon_complete.json"
# Layout (a): tag dirs in one save_dir (dragon's `step<N>`, DeepSpeed's default `global_step<N>`);
# layout (b): accelerate's `checkpoint_<i>` dirs, each a DeepSpeed save_dir of its own.
TAG_RE = re.compile(r"^(step|global_step)(\d+)$")
ACCEL_RE = re.compile(r"^(checkpoint_)(\d+)$")
# Files only DeepSpeed (or dragon.checkpoint.checkpointer, which writes its RNG file first) puts
# in a tag dir.
DS_FILE_RE = re.compile(
    r"^(.*mp_rank_\d+.*\.pt|layer_\d+-.*model_states\.pt|rng_state_\d+\.pt|"
    + re.escape(MARKER)
    + r")$"
)


def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def read_latest(save_dir: str) -> Optional[str]:
    try:  # garbage bytes are read as text, so the warning can show them
        with open(os.path.join(save_dir, "latest"), errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def list_dir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:  # gone already, or not a directory
        return []


def parse_name(name: str) -> Optional[tuple[str, int]]:
    """(naming family, number) of a checkpoint name: ('step', 7), ('checkpoint_', 3); None if
    foreign.
    """
    match = TAG_RE.match(name) or ACCEL_RE.match(name)
    return (match.group(1), int(match.group(2))) if match else None


def looks_like_tag_dir(path: str) -> bool:
    return any(DS_FILE_RE.match(name) for name in list_dir(path))


def _inner_tag(path: str) -> Optional[str]:
    """The tag a DeepSpeed save_dir's `latest` names, if it is a plain name of a sub-directory."""
    tag = read_latest(path)
    if (
        tag
        and os.sep not in tag
        and tag not in (".", "..")
        and os.path.isdir(os.path.join(path, tag))
    ):
        return tag
    return None


def _marked_dir(path: str) -> str:
    """The directory whose marker tells about `path`: a tag dir itself, or the tag a save dir's
    `latest` names (accelerate)."""
    if os.path.isfile(os.path.join(path, MARKER)):
        return path
    inner = _inner_tag(path)
    return os.path.join(path, inner) if inner else path


def _marker(path: str) -> Optional[dict]:
    """The marker of a tag dir, or of the tag a save dir's `latest` names (accelerate); None if
    none.
    """
    return _read_json(os.path.join(_marked_dir(path), MARKER))


def damage_of(path: str, checksums: bool = False) -> Optional[str]:
    """Why a complete checkpoint's files no longer match its marker (dragon.checkpoint.verify), or
    None when they do."""
    return damage(_marked_dir(path), (_marker(path) or {}).get("files"), checksums)


def is_complete(tag_dir: str) -> bool:
    """True if the save finished: a tag dir with our marker, or a save dir whose `latest` tag has
    one.
    """
    return _marker(tag_dir) is not None


def has_complete(save_dir: str) -> bool:
    """Whether save_dir holds a complete checkpoint."""
    return any(is_complete(os.path.join(save_dir, n)) for n in list_checkpoints(save_dir))


def whole_checkpoints(save_dir: str, checksums: bool = False) -> dict[str, int]:
    """{name: step} of the complete checkpoints under save_dir whose files match their marker
    (sizes; with `checksums` the CRC-32s too)."""
    return {n: s for n, s in list_checkpoints(save_dir).items()
            if is_complete(os.path.join(save_dir, n))
            and damage_of(os.path.join(save_dir, n), checksums) is None}


def list_checkpoints(save_dir: str) -> dict[str, int]:
    """{name: step} of the checkpoint dirs under save_dir, complete or not, in either layout."""
    found: dict[str, int] = {}
    for name in list_dir(save_dir):
        path, parsed = os.path.join(save_dir, name), parse_name(name)
        if parsed and parsed[0] != "checkpoint_" and looks_like_tag_dir(path):
            found[name] = parsed[1]
        elif (
            parsed
            and parsed[0] == "checkpoint_"
            and (
                os.path.isfile(os.path.join(path, "latest"))
                or any(looks_like_tag_dir(os.path.join(path, d)) for d in list_dir(path))
            )
        ):
            # accelerate's index counts saves, not steps: the marker holds the training step
            step = (_marker(path) or {}).get("step")
            found[name] = (
                step if isinstance(step, int) and not isinstance(step, bool) else parsed[1]
            )
    return found


def last_complete(save_dir: str) -> str:
    """The checkpoint a resume from `save_dir` would take now, or "none" (for messages at a stop:
    sizes only, since re-reading every byte would delay the stop)."""
    try:
        return os.path.join(*find_resume_checkpoint(save_dir, checksums=False))
    except ValueError:
        return "none"


class NoWholeCheckpoint(ValueError):
    """Checkpoints were saved, and every one is damaged."""


def find_resume_checkpoint(save_dir: str, checksums: bool = True) -> tuple[str, str]:
    """(load_dir, tag) to resume from: the tag `latest` names if complete and whole, else the
    newest one that is, saying why in one warning. Whole means every file at the size and (with
    `checksums`) the CRC-32 its marker lists, so a flipped byte falls back as a cut file does."""
    if not os.path.isdir(save_dir):
        raise ValueError(f"resume: {save_dir} is not a directory")
    latest = read_latest(save_dir)
    plain = bool(latest) and os.sep not in latest and latest not in (".", "..")
    complete = {
        n: s
        for n, s in list_checkpoints(save_dir).items()
        if is_complete(os.path.join(save_dir, n))
    }
    first = [latest] if plain and is_complete(os.path.join(save_dir, latest)) else []
    if not complete and not first:
        raise ValueError(f"resume: {save_dir} holds no complete checkpoint")
    others = sorted(set(complete) - set(first), key=lambda n: (complete[n], parse_name(n)[1], n))
    order = first + others[::-1]
    damaged = []
    for name in order:
        problem = damage_of(os.path.join(save_dir, name), checksums)
        if problem is None:
            break
        damaged.append(f"{name} is damaged ({problem})")
    else:
        raise NoWholeCheckpoint(f"none of the {len(damaged)} checkpoints in {save_dir} is whole: "
                                f"{'; '.join(damaged)}")
    accelerate = ACCEL_RE.match(name) is not None  # no `latest` of its own at this level
    if name == latest or (accelerate and not damaged):
        return load_dir_and_tag(save_dir, name)
    if damaged:
        problem = "; ".join(damaged)
    elif latest is None:
        problem = "no 'latest' file"
    elif not plain or not os.path.isdir(os.path.join(save_dir, latest)):
        problem = f"'latest' names {latest[:80]!r}, which is not a checkpoint here"
    else:
        problem = f"'latest' names {latest!r}, which is incomplete (no {MARKER})"
    warn(
        f"resume: {save_dir}: {problem}; falling back to the newest whole checkpoint {name}"
    )
    return load_dir_and_tag(save_dir, name)


def load_dir_and_tag(save_dir: str, name: str) -> tuple[str, str]:
    """(the directory DeepSpeed loads from, the tag) of checkpoint `name` in `save_dir`."""
    if ACCEL_RE.match(name):  # accelerate: load_state(path) loads the tag its `latest` names
        path = os.path.join(save_dir, name)
        return path, _inner_tag(path)
    return save_dir, name


def run_files_dir(tag_dir: str) -> str:
    """Where the recipes wrote config.json and the tokenizer for the checkpoint in `tag_dir`:
    beside its tag, or beside accelerate's checkpoint_<i> that holds it."""
    parent = os.path.dirname(os.path.normpath(tag_dir))
    return os.path.dirname(parent) if ACCEL_RE.match(os.path.basename(parent)) else parent
