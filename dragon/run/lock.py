"""One run per output directory at a time.

Before a run writes anything, the launch's first rank creates <run dir>/dragon.lock exclusively
(O_EXCL, so of two runs started at the same moment exactly one gets it) with its host, pid and
start time, and removes it when the process ends. A second run is refused in one line naming the
first. A lock whose process is gone (same host, pid not alive: a crash or SIGKILL) is stale and
taken over with a warning; one from another host is only broken by --break_lock. On storage that
every node shares, that one lock covers every node; each DiLoCo island has its own directory and
lock. With --checkpoint_storage local each node's first rank takes the lock of its own disk's
directory. Ranks that do not share the directory they should (node-local disks without that flag)
are found at start, by a rank that cannot read the lock, and refused: a checkpoint split over the
nodes' disks could not be resumed.
"""

import atexit
import json
import logging
import os
import socket
import time

import torch.distributed as dist

from dragon.checkpoint.node_local import node_leader
from dragon.errors import InputRefused

logger = logging.getLogger("dragon")
LOCK_FILE = "dragon.lock"


def take_run_lock(run_dir: str, break_lock: bool = False) -> None:
    """Hold `run_dir`'s lock until this process ends; ValueError naming the holder when another
    live run holds it."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LOCK_FILE)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    for _ in range(2):  # the second try after removing a stale or broken lock
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read(path)
            if not (break_lock or _stale(holder)):
                raise ValueError(_refusal(run_dir, holder)) from None
            logger.warning(f"{path}: taking over the lock of {_describe(holder)} "
                           f"({'--break_lock' if break_lock else 'its process is gone'})")
            _remove(path)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        atexit.register(_release, path, me["pid"])
        return
    raise ValueError(f"{path}: another run took the lock while this one broke it; try again")


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):  # being written, or damaged: treat as held by someone unknown
        return {}


def _stale(holder: dict) -> bool:
    """The holder ran on this host and its process is gone."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    try:  # a zombie (killed, not yet reaped) holds its pid but runs nothing
        with open(f"/proc/{holder['pid']}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _describe(holder: dict) -> str:
    if not holder:
        return "an unknown run"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"pid {holder.get('pid')} on {holder.get('host')}, started {started}"


def _refusal(run_dir: str, holder: dict) -> str:
    return (f"--output_dir {run_dir}: another run is using it ({_describe(holder)}; "
            f"{os.path.join(run_dir, LOCK_FILE)}); wait for it to end, choose another "
            "--output_dir, or pass --break_lock if that run is gone")


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _release(path: str, pid: int) -> None:
    if _read(path).get("pid") == pid:
        _remove(path)


def check_every_rank_sees(run_dir: str, node_local: bool = False) -> None:
    """Every rank of this world reads the lock that the launch's first rank (each node's first
    rank, `node_local`) wrote into run_dir (a collective); InputRefused on every rank when some
    rank's node does not share the directory it should."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    views = [None] * dist.get_world_size()
    seen = (socket.gethostname(), _read(os.path.join(run_dir, LOCK_FILE)), node_leader())
    dist.all_gather_object(views, seen)
    writer = [leader if node_local else 0 for _, _, leader in views]
    blind = [(r, host) for r, (host, lock, _) in enumerate(views) if lock != views[writer[r]][1]]
    if blind:
        ranks = ", ".join(f"{r} on {host}" for r, host in blind)
        raise InputRefused(
            f"--output_dir {run_dir}: rank {ranks} does not see the files rank "
            f"{writer[blind[0][0]]} writes there ({LOCK_FILE}): the ranks do not share this "
            "directory. Pass a directory every node shares (NFS, Lustre, a cloud mount), keep "
            "each node's checkpoints on its own disk (--checkpoint_storage local), or run one "
            "DiLoCo island per node (--diloco_island_index), each writing its own island<i>/")
