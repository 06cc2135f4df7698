"""--checkpoint_copy_to: each complete checkpoint copied to a store, a path or an fsspec URL.

Node-local checkpoints resume only on the nodes that wrote them; a copy on storage that other
nodes can read resumes anywhere (--resume_from_checkpoint <store>). The store is laid out as a
run's output directory: checkpoints/<tag>/, checkpoints/latest, the run files beside them, and
metrics.jsonl.

When a save completes, the ranks agree which of them copies which file: each file once, from the
first rank whose directory holds it (on node-local disks DeepSpeed writes the model states on
every node). Each copying rank copies its files on a thread of its own while training goes on,
then writes its part of the list (<tag>/copied/<rank>.json). The thread that finds every part
there writes the store's completion marker and `latest`, so that the store only ever shows a
checkpoint that is whole, and a resume checks it as it checks any; it then drops the store's
checkpoints that the run no longer keeps. Rank 0 also copies the run files. A copy that fails
says so in one warning line; the checkpoints on the nodes stay as they are.

A store given by URL (--resume_from_checkpoint s3://...) is fetched before the resume: its newest
whole checkpoint and the run files, into <output_dir>/resumed_from/ on each disk, once per disk
(download).
"""

import fcntl
import json
import logging
import os
import threading
import time
from typing import Any, Optional

import torch.distributed as dist

from dragon.checkpoint.catalog import MARKER, TAG_RE, is_complete, list_checkpoints
from dragon.parallel.distributed import rank

logger = logging.getLogger("dragon")
FETCHED = "resumed_from"  # <output_dir>/resumed_from: a store's checkpoint fetched to resume


def is_url(path: str) -> bool:
    return "://" in path


def check_store(dest: str) -> None:
    """ValueError in one line when fsspec cannot open `dest` (an unknown protocol, or one whose
    package is not installed, e.g. s3fs for s3://)."""
    import fsspec

    try:
        fsspec.core.url_to_fs(dest)
    except (ImportError, ValueError) as e:
        raise ValueError(f"--checkpoint_copy_to {dest}: fsspec cannot open it "
                         f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def download(url: str, output_dir: str) -> str:
    """The store at `url` (a run's output directory, as StoreCopy writes it), its `latest`
    checkpoint and run files fetched into <output_dir>/resumed_from once per disk (the ranks that
    share it take turns under a file lock); returns that directory. ValueError in one line when
    the store holds no complete checkpoint."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    root, local = root.rstrip("/"), os.path.join(output_dir, FETCHED)
    try:
        tag = fs.cat_file(f"{root}/checkpoints/latest").decode().strip()
        marker = json.loads(fs.cat_file(f"{root}/checkpoints/{tag}/{MARKER}"))
    except (OSError, ValueError) as e:
        raise ValueError(f"--resume_from_checkpoint {url}: no complete checkpoint there "
                         f"({type(e).__name__}: {e})") from None
    os.makedirs(os.path.join(local, "checkpoints"), exist_ok=True)
    with open(os.path.join(local, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes
        tag_dir = os.path.join(local, "checkpoints", tag)
        if is_complete(tag_dir):  # another rank of this disk fetched it
            return local
        try:
            for path in fs.ls(f"{root}/checkpoints", detail=False):  # the run files first
                if fs.isfile(path):
                    name = path.rstrip("/").rsplit("/", 1)[-1]
                    fs.get_file(path, os.path.join(local, "checkpoints", name))
            for rel in [*marker["files"], MARKER]:  # the marker last: complete once all is in
                os.makedirs(os.path.dirname(os.path.join(tag_dir, rel)), exist_ok=True)
                fs.get_file(f"{root}/checkpoints/{tag}/{rel}", os.path.join(tag_dir, rel))
        except OSError as e:
            raise ValueError(f"--resume_from_checkpoint {url}: fetching {tag} into {local} "
                             f"failed ({type(e).__name__}: {e})") from None
    return local


class StoreCopy:
    """Copies of a run's complete checkpoints in `dest` (module docstring)."""

    def __init__(self, dest: str, run_dir: str):
        import fsspec  # datasets' dependency; only a run that copies loads it

        self.dest, self.run_dir = dest, run_dir
        self.fs, root = fsspec.core.url_to_fs(dest)
        self.root = root.rstrip("/") or "/"
        self.thread: Optional[threading.Thread] = None
        self.failed: Optional[str] = None

    def start(self, save_dir: str, tag: str, step: int, files: Optional[dict]) -> None:
        """Begin copying checkpoint `tag` of save_dir (a collective). `files`: the manifest this
        rank's marker lists, None on a rank that wrote no marker."""
        mine_now = (files, time.time_ns())  # rank 0's time names this save in the store
        shares: list[Any] = [mine_now]
        if dist.is_initialized():
            shares = [None] * dist.get_world_size()
            dist.all_gather_object(shares, mine_now)
        save_id, shares = shares[0][1], [listed for listed, _ in shares]
        owner: dict[str, int] = {}
        for r, listed in enumerate(shares):
            for rel in sorted(listed or {}):
                owner.setdefault(rel, r)
        self.wait()  # the checkpoints land in the store in the order they were saved
        if rank() not in owner.values():
            return
        merged = {rel: shares[r][rel] for rel, r in owner.items()}
        mine = sorted(rel for rel, r in owner.items() if r == rank())
        kept = list(list_checkpoints(save_dir))
        job = (save_dir, tag, step, mine, merged, sorted(set(owner.values())), kept, save_id)
        self.thread = threading.Thread(target=self._copy, args=job, name="dragon-store-copy",
                                       daemon=True)
        self.thread.start()

    def wait(self) -> None:
        """Return once this rank's copy in flight is done (or has failed)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def _copy(self, save_dir: str, tag: str, step: int, mine: list[str], merged: dict,
              copiers: list[int], kept: list[str], save_id: int) -> None:
        remote = f"{self.root}/checkpoints/{tag}"
        try:
            self._remove(f"{remote}/{MARKER}")  # the tag is incomplete until all of it is new
            self._remove(f"{remote}/copied/{rank()}.json")
            for rel in mine:
                self._put(os.path.join(save_dir, tag, rel), f"{remote}/{rel}")
            if rank() == 0:
                self._copy_run_files(save_dir)
            part = {"save": save_id, "files": {rel: merged[rel] for rel in mine}}
            self._write(f"{remote}/copied/{rank()}.json", json.dumps(part))
            if all(self._part_of(f"{remote}/copied/{r}.json") == save_id for r in copiers):
                marker = {"step": step, "tag": tag, "time": time.time(), "files": merged}
                self._write(f"{remote}/{MARKER}", json.dumps(marker))
                self._write(f"{self.root}/checkpoints/latest", tag)
                self._prune(kept, step)  # every part of every older copy is in by now
        except Exception as e:  # the run trains on: its own checkpoints are whole
            self.failed = f"{type(e).__name__}: {e}"
            logger.warning(f"--checkpoint_copy_to {self.dest}: copying {tag} failed "
                           f"({self.failed}); the checkpoints in {save_dir} are unchanged")

    def _put(self, local: str, remote: str) -> None:
        self.fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)
        self.fs.put_file(local, remote)

    def _write(self, remote: str, text: str) -> None:
        self.fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)
        self.fs.pipe_file(remote, text.encode())

    def _part_of(self, remote: str) -> Optional[int]:
        """The save a copying rank's part belongs to (None: not there yet); a part left by an
        interrupted copy of an earlier save of the same tag is another save's."""
        try:
            return json.loads(self.fs.cat_file(remote)).get("save")
        except (OSError, ValueError):
            return None

    def _remove(self, remote: str) -> None:
        if self.fs.exists(remote):
            self.fs.rm(remote)

    def _copy_run_files(self, save_dir: str) -> None:
        """The files beside the checkpoints (config.json, run.json, the tokenizer) and the
        metrics, from which a resume from the store reads the run."""
        for name in sorted(os.listdir(save_dir)):
            path = os.path.join(save_dir, name)
            if os.path.isfile(path) and name != "latest":
                self._put(path, f"{self.root}/checkpoints/{name}")
        metrics = os.path.join(self.run_dir, "metrics.jsonl")
        if os.path.isfile(metrics):
            self._put(metrics, f"{self.root}/metrics.jsonl")

    def _prune(self, kept: list[str], step: int) -> None:
        """The store keeps the checkpoints that the run keeps (of those before `step`: a newer
        one may be on its way in)."""
        for path in self.fs.ls(f"{self.root}/checkpoints", detail=False):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            match = TAG_RE.match(name)
            if name not in kept and match and int(match.group(2)) < step and self.fs.isdir(path):
                try:
                    self.fs.rm(path, recursive=True)
                except FileNotFoundError:  # another node's copy thread removed it first
                    pass
