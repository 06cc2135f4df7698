"""Islands for DiLoCo: each island is its own torch.distributed world; islands meet in a gloo group.

DeepSpeed's engines (the pipeline engine above all) cannot be confined to a subgroup of one
world, so every island gets a world of its own and DeepSpeed never sees the others. Rank r of
island i meets rank r of every other island in a cross-island ProcessGroupGloo of n_islands
members, so the outer all-reduce is sharded exactly as an island shards its weights.

Two ways to lay islands out:

* one launch for all islands (torchrun / deepspeed / accelerate): the launch's WORLD_SIZE is
  split into contiguous blocks, island i = ranks [i*S, (i+1)*S). Before DeepSpeed starts, each
  process rewrites RANK / WORLD_SIZE to its island's and starts its island's world itself,
  rendezvousing through the launch's store (MASTER_ADDR:MASTER_PORT: torchrun's agent store,
  or one hosted by launch rank 0), under a per-island prefix. That works across nodes, since
  no island needs to know where its rank 0 runs.
* one launch per island (islands on different clusters): each launch is an ordinary world,
  given --diloco_island_index and --diloco_store HOST:PORT; island 0's rank 0 hosts the store.
"""

import os
import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

_PREFIX = "dragon-diloco"


@dataclass
class Topology:
    """Where this process sits: island `island` of `islands`, rank `island_rank` of `island_size`.
    """

    islands: int = 1
    island: int = 0
    island_rank: int = 0
    island_size: int = 1
    cross_group: Optional[Any] = field(default=None, repr=False)  # ProcessGroupGloo across islands
    # kept alive: the groups rendezvous through it
    store: Optional[Any] = field(default=None, repr=False)
    timeout_s: float = 600.0  # of the cross-island collectives

    @property
    def launch_rank(self) -> int:
        """Rank across all islands (the launch's RANK in a single launch)."""
        return self.island * self.island_size + self.island_rank

    def data_shard(self, dp_rank: int, dp_world: int) -> tuple[int, int]:
        """(data rank, data world) across all islands: island i's data rank d reads what data rank
        i * dp_world + d of one data-parallel job over every island's ranks would read."""
        return self.island * dp_world + dp_rank, self.islands * dp_world

    def reach(self, step: int) -> None:
        """Record in the store that this rank reached the outer step after inner step `step`."""
        if self.store is not None:
            self.store.set(self._reached_key(self.island), str(step))

    def missing(self, step: int) -> list[int]:
        """The islands whose rank (this rank's index in its island) has not reached `step`; [0]
        when the store itself is gone (island 0's first rank, or the launcher, hosts it)."""
        try:
            keys = {i: self._reached_key(i) for i in range(self.islands) if i != self.island}
            return [
                i
                for i, key in keys.items()
                if not self.store.check([key]) or int(self.store.get(key)) < step
            ]
        except (RuntimeError, ValueError):
            return [0]

    def lost(self, step: int, error: Exception) -> str:
        """The one-line reason when a cross-island collective of the outer step after `step` fails:
        which islands are missing, and what gloo said."""
        missing = ", ".join(map(str, self.missing(step)))
        # gloo's "[file:line] Read error [host]:port: Connection reset by peer. This is ..."
        cause = re.sub(r"^\[[^\]]*\] ", "", str(error).splitlines()[0] if str(error) else "")
        cause = cause.split(". ")[0][:160] or type(error).__name__
        return (
            f"step {step}: island {missing} did not reach this outer step ({cause}); "
            "restart every island with --resume_from_checkpoint latest"
        )

    def _reached_key(self, island: int) -> str:
        return f"{_PREFIX}/reached/island{island}/rank{self.island_rank}"

    def barrier(self) -> None:
        """Wait for every island (rank r of each). Call after the last outer sync, so that no
        process hosting the store exits while another island still needs it."""
        if self.cross_group is not None:
            self.cross_group.barrier().wait()


def _parse_store(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--diloco_store {address!r}: expected HOST:PORT")
    return host, int(port)


def enter_island(args, timeout_s: float = 600.0) -> Topology:
    """Put this process into its island before DeepSpeed starts; connect the cross-island group.

    `args` has diloco_islands, diloco_island_index (None: one launch holds every island),
    diloco_store (HOST:PORT, needed with diloco_island_index), diloco_store_external (no island
    hosts the store) and diloco_elastic (no static cross-island group: dragon.diloco.membership).
    With one island nothing changes: the launch is the island and there is no cross-island group.
    """
    islands = args.diloco_islands
    index = args.diloco_island_index
    if islands == 1 and index is None:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return Topology(1, 0, int(os.environ.get("RANK", "0")), world)
    timeout = timedelta(seconds=timeout_s)
    if "RANK" not in os.environ:  # no launcher: a one-process island
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    launch_rank, launch_world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    if index is not None:  # one launch per island: this launch's world is the island's world
        host, port = _parse_store(args.diloco_store)
        store = dist.TCPStore(
            host,
            port,
            world_size=None,
            is_master=index == 0 and launch_rank == 0 and not args.diloco_store_external,
            timeout=timeout,
            wait_for_workers=False,
        )
        topology = Topology(
            islands, index, launch_rank, launch_world, store=store, timeout_s=timeout_s
        )
    else:
        topology = _split_launch(islands, launch_rank, launch_world, timeout_s)
    if islands > 1 and not args.diloco_elastic:  # elastic islands meet in per-step groups
        prefix = f"{_PREFIX}/cross/rank{topology.island_rank}"
        topology.cross_group = dist.ProcessGroupGloo(
            dist.PrefixStore(prefix, topology.store), topology.island, islands, timeout
        )
    return topology


def _split_launch(islands: int, launch_rank: int, launch_world: int, timeout_s: float) -> Topology:
    """One launch holds every island: this rank's block of ranks becomes its island's own world,
    started through the launcher's store under a per-island prefix."""
    timeout = timedelta(seconds=timeout_s)
    size = launch_world // islands  # dragon.parallel.layout checked that it divides
    island, island_rank = divmod(launch_rank, size)
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    agent_store = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None) == "True"  # torchrun's
    store = dist.TCPStore(
        host,
        port,
        world_size=None,
        is_master=launch_rank == 0 and not agent_store,
        timeout=timeout,
        wait_for_workers=False,
    )
    # The island's own world, as DeepSpeed will see it. MASTER_PORT is only a name from here
    # on (DeepSpeed's CPU shared-memory op names its segments after it): one per island.
    # LOCAL_WORLD_SIZE stays the processes on this node (CPU threads are shared out by it).
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", str(launch_world)))
    os.environ.update(
        RANK=str(island_rank), WORLD_SIZE=str(size), MASTER_PORT=str(port + 1 + island)
    )
    from deepspeed.accelerator import get_accelerator

    dist.init_process_group(
        get_accelerator().communication_backend_name(),
        store=dist.PrefixStore(f"{_PREFIX}/island{island}", store),
        rank=island_rank,
        world_size=size,
        timeout=timeout,
    )
    return Topology(islands, island, island_rank, size, store=store, timeout_s=timeout_s)
