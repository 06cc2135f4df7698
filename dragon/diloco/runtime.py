"""What the outer loop of a rank (dragon.diloco.outer) runs on: the weights, membership, codec,
exchange thread, link watch and metrics, and the steps around a round."""

from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from dragon.diloco.config import DiLoCoConfig
from dragon.diloco.link_watch import LinkWatch
from dragon.diloco.membership import ElasticIslands, FixedGroup
from dragon.diloco.outer_metrics import OuterMetrics
from dragon.errors import IslandLost
from dragon.parallel.topology import Topology
from dragon.wire.codecs import codec_for
from dragon.wire.exchange import Exchange, broadcast_object, flatten
from dragon.wire.exchange_thread import ExchangeThread


class OuterRuntime:
    """One rank's side of the islands. `weights`: a MasterWeights, or anything with tensors(),
    publish(), replicas, excluded and fingerprint(); `group`: the last outer step's members'."""

    def __init__(self, weights, config: DiLoCoConfig, topology: Topology):
        self.weights, self.config, self.topology = weights, config, topology
        self.islands = topology.islands
        masters = weights.tensors()
        self.numels = [t.numel() for t in masters]
        self.device = torch.device("cpu") if config.outer_on_cpu else masters[0].device
        self.membership = membership_for(config, topology)
        self.group = self.membership.first_group(config.join)
        self.adopt_island0_weights()
        self.report = OuterMetrics(weights, config, self.numels)
        self.background = None  # delayed: the thread the exchanges run on
        if (config.mode == "delayed" and config.exchange_thread and not config.elastic
                and self.group is not None):
            self.background = ExchangeThread(topology)
        self.codec = codec_for(config.compress, config.int8_block, config.topk,
                               config.sparse_chunk)
        self.link = LinkWatch(config.inner_steps, config.fragments, config.compress,
                              config.int8_block)

    def run(self, step: int, final: bool, due: Callable[[int, bool], bool],
            outer_step: Callable[[int, bool], dict]) -> dict:
        """After inner step `step`: outer_step(step, final) if due, else {}; raises IslandLost."""
        if self.background is not None:
            self.background.tick(step)
        self.link.begin()
        try:
            if not due(step, final):
                return {}
            self.topology.reach(step)
            return outer_step(step, final)
        except RuntimeError as e:  # gloo: an island's connection closed, or the timeout passed
            raise IslandLost(self.topology.lost(step, e)) from None
        finally:
            self.link.end()

    def exchange(self, delta: torch.Tensor, group, islands: int,
                 contributors: Optional[int] = None, numels: Optional[list[int]] = None,
                 then: Optional[Callable[[int], None]] = None) -> Exchange:
        """Start an exchange among the group's `islands`, averaged over `contributors` (default
        all; an elastic joiner adds zeros); delayed: `then(ready_after)` runs once it is ready."""
        return Exchange(delta, group, islands, self.codec, numels or self.numels,
                        measure_bytes=self.config.mode == "sync", contributors=contributors,
                        background=self.background, then=then)

    def waited(self, exchanges: list) -> None:
        """Tell the link watch about each of `exchanges` that an inner step waited for."""
        for exchange in exchanges:
            if exchange.blocked > 0:
                self.link.waited(exchange)

    def adopt_island0_weights(self) -> None:
        """Start every island from island 0's weights (rank r of each holds the same shard)."""
        if self.islands > 1 and self.group is not None:
            flat = flatten(self.weights.tensors())
            self.group.broadcast(flat, 0).wait()
            self.write(flat.split(self.numels))

    @torch.no_grad()
    def write(self, values) -> None:
        """theta into the fp32 master weights, then into the module's working weights."""
        for m, v in zip(self.weights.tensors(), values):
            m.copy_(v.view_as(m))
        self.weights.publish()

    def shape(self) -> dict:
        """What a joiner must match."""
        return {"parameters on this rank": sum(self.numels), "H": self.config.inner_steps,
                "islands": self.islands, "fragments": self.config.fragments}

    def share_state(self, group, members: list[int], joiners: list[int], state: dict) -> dict:
        """The first non-joining member's `state`, on every member (joiners' own is not read)."""
        root = members.index(min(i for i in members if i not in joiners))
        joining = self.topology.island in joiners
        return broadcast_object(None if joining else state, group, root)

    def share_outer_state(self, group, members: list[int], joiners: list[int], step: int,
                          fragments: list, extra: Any = None) -> tuple[int, Any]:
        """The first non-joining member's fragments (theta_outer, outer optimizer state), which
        joiners load, and its (step, extra), which this returns."""
        state = self.share_state(group, members, joiners, {
            "step": step, "theta_outer": [f.outer.detach().cpu() for f in fragments],
            "optimizer": [f.optimizer.state_dict() for f in fragments], "extra": extra})
        if self.topology.island in joiners:
            with torch.no_grad():
                for fragment, outer, optimizer in zip(fragments, state["theta_outer"],
                                                      state["optimizer"]):
                    fragment.outer.copy_(outer.view_as(fragment.outer))
                    fragment.optimizer.load_state_dict(optimizer)
        return state["step"], state["extra"]

    def check_same_step(self, step: int, what: str = "steps") -> None:
        """Raise unless every island resumed at the same step (a collective across islands)."""
        if self.group is None:
            return
        t = torch.tensor([step, -step], dtype=torch.float64)
        self.group.allreduce([t], dist.ReduceOp.MAX).wait()
        if t[0] != -t[1]:
            raise RuntimeError(
                f"islands resumed from different {what} ({int(-t[1])} to {int(t[0])}); "
                "resume every island from the same checkpoint step"
            )

    def close(self, ended_at: Optional[int] = None) -> None:
        """After the last outer step: stop the exchange thread and end the membership's run."""
        if self.background is not None:
            self.background.close()
        self.membership.finish(ended_at)


def membership_for(config: DiLoCoConfig, topology: Topology) -> Union[FixedGroup, ElasticIslands]:
    """Elastic islands with --diloco_elastic, else every island in every outer step."""
    if not config.elastic:
        return FixedGroup(topology)
    late_landing = config.mode == "sync" and config.fragments == 1
    return ElasticIslands(topology, config.quorum_timeout, config.min_islands, topology.timeout_s,
                          late_landing)


def resumable_state(saved, own_file: str, laid_out: Callable[[str], Optional[dict]]
                    ) -> Optional[Any]:
    """The state to load when the checkpoint lacks this rank's own: laid out from another
    partition, or island 0's file (dragon.checkpoint.checkpointer.Saved); None: no DiLoCo."""
    return laid_out(saved.tag_dir) if saved.relaid else saved.rank_file(own_file)
