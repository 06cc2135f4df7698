"""Checkpoints on node-local disks (--checkpoint_storage local).

Many clouds give each node a local disk and no shared one. With --checkpoint_storage local,
DeepSpeed's own `checkpoint.use_node_local_storage` is on: each node's first rank writes the
files that one rank writes on shared storage (the model states), and every rank its own shards,
under the same --output_dir path on its node's disk. dragon does the rest per node: each node's
first rank takes the run lock, writes the run files, the completion marker and `latest` in its
directory, and prunes it (dragon.checkpoint.save_hook). Each marker names its node and the ranks
whose files it holds, so that a resume on other nodes is refused in one line rather than
loading another rank's shard.

Nodes can disagree on their newest checkpoint (a node killed between its marker and another
node's), so a resume agrees before anything loads: every node resumes the newest checkpoint that
every node holds whole (agree_on_tag). --checkpoint_copy_to copies each checkpoint to a store
that other nodes can read (dragon.checkpoint.store_copy).
"""

import json
import logging
import os
import socket
from typing import Any, Optional

import torch.distributed as dist

from dragon.checkpoint.catalog import MARKER, TAG_RE, whole_checkpoints
from dragon.checkpoint.store_copy import check_store
from dragon.errors import InputRefused

logger = logging.getLogger("dragon")
LOCAL = "local"


def node_leader() -> int:
    """The global rank of this node's first rank (launchers number a node's ranks in a row)."""
    return int(os.environ.get("RANK", "0")) - int(os.environ.get("LOCAL_RANK", "0"))


def set_storage(args: Any, ds_config: dict, refused: Optional[str]) -> None:
    """Set DeepSpeed's use_node_local_storage for --checkpoint_storage local (a JSON that sets it
    asks for local storage too); ValueError in one line where `refused`, the recipe's reason it
    cannot keep node-local checkpoints, is given, and when the --checkpoint_copy_to store cannot
    be opened."""
    if args.checkpoint_copy_to:
        check_store(args.checkpoint_copy_to)
    section = ds_config.get("checkpoint", {})
    by_json = bool(section.get("use_node_local_storage"))
    if by_json:
        args.checkpoint_storage = LOCAL
    if args.checkpoint_storage != LOCAL:
        return
    if refused:
        asked = ("the DeepSpeed JSON's checkpoint.use_node_local_storage" if by_json
                 else "--checkpoint_storage local")
        raise ValueError(f"{asked}: {refused}; keep the checkpoints on storage every node "
                         "shares (--checkpoint_storage shared)")
    ds_config.setdefault("checkpoint", {})["use_node_local_storage"] = True


def names_a_tag(resume: Optional[str]) -> bool:
    """Whether --resume_from_checkpoint names one checkpoint (a tag, or a tag's directory)
    rather than a run's newest (auto, latest, a run's directory)."""
    if resume in (None, "auto", "latest"):
        return False
    return os.sep not in resume or bool(TAG_RE.match(os.path.basename(os.path.normpath(resume))))


def ranks_on_this_node() -> list[int]:
    """The global ranks that share this node's disk (a collective)."""
    if not dist.is_initialized():
        return [0]
    leaders: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(leaders, node_leader())
    return [r for r, leader in enumerate(leaders) if leader == node_leader()]


def node_entry(ranks: list[int]) -> dict:
    """What a node's completion marker says of it: its host and the ranks whose files it holds."""
    return {"host": socket.gethostname(), "ranks": ranks}


def uses_node_local_storage(engine: Any) -> bool:
    """Whether `engine` keeps its checkpoints on node-local disks (DeepSpeed's config says)."""
    return hasattr(engine, "use_node_local_storage") and bool(engine.use_node_local_storage())


def agree_on_tag(save_dir: str, target: Optional[tuple[str, str]], named: bool) -> Optional[str]:
    """The checkpoint of save_dir that every rank resumes from when each node keeps its own
    (a collective): the newest one every node holds whole, or the one a `named` resume names.
    `target`: this rank's (load_dir, tag) as preflight resolved it, None for a fresh start.
    None: nothing to agree on, `target` stands (a resume from elsewhere, checked to be one
    checkpoint on every rank). InputRefused on every rank when no checkpoint fits while some
    node holds one, or when a node's directory holds other ranks' files."""
    if not dist.is_initialized():
        return None
    elsewhere = target is not None and os.path.abspath(target[0]) != os.path.abspath(save_dir)
    views: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(views, (node_leader(), socket.gethostname(), whole_checkpoints(save_dir),
                                   target and target[1], elsewhere))
    if any(view[4] for view in views):  # every rank's from elsewhere: one and the same tag
        tags = sorted({str(view[3]) for view in views})
        if len(tags) > 1 or not all(view[4] for view in views):
            raise InputRefused(f"--resume_from_checkpoint: the nodes resolved different "
                               f"checkpoints ({', '.join(tags)}); the store changed while they "
                               "read it: start them again")
        return None
    nodes = {leader: (host, whole) for leader, host, whole, _, _ in views}
    if not any(whole for _, whole in nodes.values()):
        return None  # a first start on every node
    common = set.intersection(*(set(whole) for _, whole in nodes.values()))
    asked = {view[3] for view in views if view[3] is not None} if named else set()
    if not common or (asked and not asked <= common):
        held = "; ".join(f"the node of rank {leader} ({host}): "
                         f"{', '.join(sorted(whole, key=whole.get)) or 'none'}"
                         for leader, (host, whole) in sorted(nodes.items()))
        raise InputRefused(
            f"--checkpoint_storage local: no checkpoint in {save_dir} is whole on every node "
            f"({held}); start each node on the disk it saved to, or resume every node from a "
            "copy (--resume_from_checkpoint <the --checkpoint_copy_to store>)")
    whole = nodes[min(nodes)][1]
    tag = min(asked) if asked else max(common, key=lambda t: (whole[t], t))
    _check_ranks_held(os.path.join(save_dir, tag), views)
    if (target is None or target[1] != tag) and node_leader() == int(os.environ.get("RANK", 0)):
        logger.warning(f"{save_dir}: {target[1] if target else 'no checkpoint'} on this node, "
                       f"{tag} whole on every node: resuming {tag}")
    return tag


def _check_ranks_held(tag_dir: str, views: list) -> None:
    """InputRefused on every rank when some rank's node holds a marker naming other ranks."""
    with open(os.path.join(tag_dir, MARKER)) as f:
        held = json.load(f).get("node", {}).get("ranks")
    mine = held is None or int(os.environ.get("RANK", "0")) in held
    verdicts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, (mine, held))
    wrong = [(r, ranks) for r, (ok, ranks) in enumerate(verdicts) if not ok]
    if wrong:
        r, ranks = wrong[0]
        raise InputRefused(
            f"--checkpoint_storage local: rank {r} runs on the node of rank {views[r][0]}, whose "
            f"{os.path.basename(tag_dir)} holds the files of ranks {ranks}; start every node with "
            "the node rank it saved with, or resume from a copy on storage every node reads")
