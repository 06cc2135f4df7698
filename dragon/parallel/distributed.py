"""Process-group start-up that works under deepspeed, torchrun, accelerate or no launcher at all."""

import atexit
import gc
import os
import re
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from dragon.errors import PeerLost


def launcher_world_size() -> int:
    """World size the launcher announced, readable before any process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_STARTED = False  # whether this process started a process group (init_distributed)


def started_distributed() -> bool:
    """Whether init_distributed ran in this process (its groups may be torn down since)."""
    return _STARTED


def init_distributed(timeout_s: float = 600.0) -> None:
    """Start DeepSpeed's process group (gloo on CPU, nccl on CUDA) with a bounded timeout.

    With no launcher, a one-process world is set up by hand; otherwise DeepSpeed would look for
    mpi4py. On CPU each rank gets an equal share of the cores (unless OMP_NUM_THREADS says how
    many), so ranks do not oversubscribe.
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    else:
        accelerator.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(timeout=timedelta(seconds=timeout_s))
    global _STARTED
    _STARTED = True
    # The interpreter's last garbage collection walks every object torch, DeepSpeed and
    # transformers created, for over a second per rank; frozen objects are skipped, and the
    # operating system frees the memory. Files are closed by their owners before exit.
    atexit.register(gc.freeze)


def end_distributed() -> None:
    """Tear down every process group while the interpreter is whole, once every rank is past its
    last collective: left to the interpreter's exit, gloo's threads now and then abort the process
    (SIGABRT, "terminate called without an active exception") after the run succeeded."""
    if dist.is_initialized():
        dist.destroy_process_group()


# What gloo, NCCL and the TCPStore say when a peer process is gone or its link broke (torch
# raises some of these as a plain RuntimeError, through DeepSpeed's comm wrappers too).
_PEER_FAILURE = re.compile(
    r"gloo|Connection (reset|closed|refused)|Broken pipe|Failed to recv|[Tt]imed out|NCCL"
)


def peer_failed(error: Exception) -> bool:
    """Whether `error` is a collective's (or the store's) failure to reach another rank."""
    return isinstance(error, dist.DistError) or bool(_PEER_FAILURE.search(str(error)))


def peer_lost(error: Exception) -> PeerLost:
    """The one line for a collective that could not reach another rank: the peer's address and
    gloo's reason ("Read error [10.0.0.2]:4567: Connection reset by peer"), or the timeout
    after which a peer that vanished without closing its connections (a machine powered off)
    counts as lost (--dist_timeout)."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    cause = re.sub(r"^\[[^\]]*\] ", "", text).split(". ")[0][:200]  # gloo's "[file.cc:1] "
    peer = re.search(r"\[([0-9A-Fa-f.:]+)\]:\d+", cause)
    who = f"the rank(s) at {peer.group(1)} are" if peer else "a rank of another process is"
    return PeerLost(
        f"a collective failed: {who} gone or unreachable ({cause}); restart every node with "
        "--resume_from_checkpoint auto"
    )


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce_mean(values: list[float], weights: list[float] | None = None) -> list[float]:
    """Weighted mean of per-rank values over all ranks (one small all-reduce)."""
    weights = weights or [1.0] * len(values)
    t = torch.tensor([v * w for v, w in zip(values, weights)] + list(weights), dtype=torch.float64)
    if dist.is_initialized():
        t = t.to(_device())
        dist.all_reduce(t)
        t = t.cpu()
    n = len(values)
    return [(t[i] / t[n + i]).item() for i in range(n)]


def all_reduce_values(values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
    """Reduce a few numbers over this world in float64 (as they are without one)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=op)
    return t.cpu().tolist()


def _device() -> torch.device:
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())
