"""DiLoCo (Douillard et al., 2023): islands train on their own and meet every H steps for an outer
step.

Inside an island every step is an ordinary DeepSpeed step. Every H steps each rank takes its
pseudo-gradient Delta = theta_outer - theta_inner, in fp32, on its own part of DeepSpeed's fp32
MASTER weights (its partition under ZeRO-1/2/3 and the bf16 optimizer, its stage's weights in
a pipeline, the whole model under ZeRO-0), averages Delta with rank r of every other island
(dragon.parallel.topology), steps an outer optimizer (Nesterov SGD by default) on theta_outer
with the average as gradient (delayed mode: see below), and writes theta_outer back into the
master weights and the module's working weights. theta_outer and the outer optimizer's state
are fp32, on the master weights' device or on CPU (--diloco_outer_on_cpu).

Modes. sync: the all-reduce blocks. delayed: the exchange of outer step k runs on the exchange
thread (dragon.diloco.background; --diloco_exchange_thread false: its collectives are issued on
the training thread, int4's all-to-all blocking) while the inner steps of k+1 compute and is
applied at step k+1, one outer step late, with the "eager updates" of
Kale et al. (2025): each island keeps its own theta_outer and outer optimizer, and at outer step k
feeds it the average that just arrived (of step k-1) with this island's share of it, Delta_{k-1}/n,
replaced by its fresh Delta_k/n (n islands). Each island's own progress thus passes through the
outer optimizer, momentum included, as soon as it is made; only the other islands' part is late.
At the first outer step no average has arrived yet, so the island steps on its fresh share alone;
the last one replaces the fresh share with the blocking average of the last window and then
averages theta_outer over the islands (their momenta differ), so training ends with every island
on the same weights. With top-k, an island's share is what it sent; the rest waits in its
residual.

Streaming DiLoCo (--diloco_fragments F > 1: the weights in fragments synced in turn) is
dragon.diloco.fragments.FragmentedDiLoCo (dragon.diloco.build chooses between them).

Compression (the outer step stays fp32; dragon.diloco.exchange): bf16 all-reduces Delta in
bf16; int8 quantizes Delta with one absmax scale per block of --diloco_int8_block values (0: per
tensor) and all-gathers the codes; int4 reduces 4-bit chunks and all-gathers the sums
(dragon.diloco.quantized); top-k sends the largest entries and keeps the rest for later
(dragon.diloco.sparse). The relative error ||Q(Delta) - Delta|| / ||Delta|| of this island's
Deltas is logged. Bytes on the wire per rank, for n islands and a payload of P bytes: fp32, bf16
and int4 2(n-1)/n * P, int8 and top-k (all-gathers) (n-1) * P.

Metrics of an outer step (in each island's metrics.jsonl): outer_step; outer_grad_norm (of the
islands' average applied at this step, over the whole model; in delayed mode the late one, and
absent at the first step); outer_bytes_sent (the most any rank of the island sent: measured from
/proc/self/io around the blocking exchange in sync mode, the ring model above in delayed mode,
whose last step adds the average of theta_outer), outer_peak_bytes (the most of any outer step
before the last, so far) and outer_payload_bytes (this rank's);
outer_comm_seconds (start to completion of the exchanges of averages applied; not the last
step's average of theta_outer) and, delayed, outer_comm_hidden_seconds (the part of it that ran
under inner steps) and outer_wait_seconds (what the training thread waited for them, a save's
wait included); outer_compress_error; outer_seconds (the whole outer step);
with --diloco_checksum, float64 sums and sums of squares of the working weights and of
theta_outer over the island's ranks (equal bits on every island after a sync outer step).

Inner optimizer state, LR schedule and data stream stay per island, as in DiLoCo.

Elastic (--diloco_elastic): each outer step averages over the islands that reach it
(dragon.diloco.membership, dragon.diloco.elastic), outer_quorum records how many; an island
lost during the exchange is left out of a retry. The average is over the members only, so a
lone island steps on its own Delta. Delayed: an average in flight that failed (an island died
during it) is redone at the next outer step from the survivors' kept Deltas, so the late average
is the survivors' average.
"""

import math
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from dragon.parallel.distributed import all_reduce_values
from dragon.diloco.background import Background, LinkWatch
from dragon.diloco.codecs import Codec, codec_for
from dragon.diloco.exchange import Exchange, RoundOutcome, flatten
from dragon.diloco.membership import ElasticIslands, FixedGroup
from dragon.diloco.elastic import ElasticRounds
from dragon.diloco.state import OuterState
from dragon.errors import IslandLost
from dragon.parallel.topology import Topology


@dataclass
class DiLoCoConfig:
    """What the outer loop needs to know (dragon.diloco.arguments.DiLoCoArguments.config())."""

    inner_steps: int  # H
    mode: str = "sync"  # or "delayed"
    compress: str = "none"  # the pseudo-gradient on the wire: none (fp32), bf16, int8, int4, topk
    topk: float = 0.0  # compress "topk": the fraction of entries sent, with error feedback
    int8_block: int = 1024  # values per int8 or int4 scale (0: one per tensor, int8 only)
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    outer_on_cpu: bool = False
    checksum: bool = False  # log a fingerprint of the weights after every outer step
    elastic: bool = False  # islands may die and join (dragon.diloco.membership)
    quorum_timeout: float = 60.0
    min_islands: int = 1
    join: bool = False  # this island joins live ones
    fragments: int = 1  # streaming DiLoCo: fragments synced in turn (dragon.diloco.fragments)
    # delayed, fragments: inner steps a fragment's exchange runs under, or "auto" (until done)
    fragment_delay: Union[int, str] = 0
    fragment_alpha: float = 0.5  # delayed, fragments: the local share kept when a fragment lands
    exchange_thread: bool = True  # delayed: the exchange's collectives off the training thread

    def outer_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        """torch SGD with the outer lr and momentum (Nesterov unless momentum is 0)."""
        momentum = self.outer_momentum
        return torch.optim.SGD(params, lr=self.outer_lr, momentum=momentum,
                               nesterov=self.nesterov and momentum > 0)


class DiLoCo(OuterState, ElasticRounds):
    """The outer loop of one rank: call maybe_outer_step(step) after every inner step.

    `weights` is a MasterWeights (or anything with tensors(), publish(), replicas, excluded and
    fingerprint()); `outer_optimizer(params)` builds any torch optimizer over theta_outer.
    """

    def __init__(
        self,
        weights,
        config: DiLoCoConfig,
        topology: Topology,
        outer_optimizer: Optional[Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = None,
    ):
        self.weights, self.config, self.topology = weights, config, topology
        self.H, self.mode = config.inner_steps, config.mode
        self.islands, self.group = topology.islands, topology.cross_group
        masters = weights.tensors()
        self.numels = [t.numel() for t in masters]
        self.device = torch.device("cpu") if config.outer_on_cpu else masters[0].device
        self.membership = membership_for(config, topology)
        self.group = self.membership.first_group(config.join)
        self._adopt_island0_weights()
        self.outer_params = [m.detach().to(self.device, torch.float32, copy=True) for m in masters]
        self._make_optimizer = outer_optimizer or config.outer_optimizer
        self.optimizer = self._make_optimizer(self.outer_params)
        # delayed: this island's pseudo-gradient in flight, and the exchange carrying it
        self.previous = torch.zeros(sum(self.numels)) if self.mode == "delayed" else None
        self.pending: Optional[Exchange] = None
        self.previous_share = self.islands  # what the late average divided `previous` by
        # top-k: what this rank has not sent yet, added to its next pseudo-gradient
        self.residual = torch.zeros(sum(self.numels)) if config.compress == "topk" else None
        self.contributed = True  # `previous` is this island's share of it
        self.outer_step = 0
        self.peak_bytes = 0  # the most any outer step before the last sent
        self.background = None  # delayed: the thread the exchanges run on
        if (self.mode == "delayed" and config.exchange_thread and not config.elastic
                and self.group is not None):
            self.background = Background(topology)
        self.codec = codec_for(config.compress, config.int8_block, config.topk)
        self.link = LinkWatch(self.H, config.fragments, config.compress, config.int8_block)

    def is_boundary(self, step: int, final: bool = False) -> bool:
        """Whether a checkpoint may be taken after inner step `step`."""
        return step % self.H == 0 or final

    def is_due(self, step: int, final: bool) -> bool:
        """Whether anything of the outer loop happens after inner step `step`."""
        return self.is_boundary(step, final)

    def maybe_outer_step(self, step: int, final: bool = False) -> dict:
        """After inner step `step` (1-based): the outer step when one is due, with its metrics; else
        {}. `final` makes the last step an outer step and, in delayed mode, applies what is in
        flight."""
        if self.background is not None:
            self.background.tick(step)
        self.link.begin()
        try:
            if not self.is_due(step, final):
                return {}
            self.topology.reach(step)
            return self._outer_step(step, final)
        except RuntimeError as e:  # gloo: an island's connection closed, or the timeout passed
            raise IslandLost(self.topology.lost(step, e)) from None
        finally:
            self.link.end()

    def _outer_step(self, step: int, final: bool, joining: Optional[tuple] = None) -> dict:
        start = time.perf_counter()
        self.outer_step += 1
        masters = self.weights.tensors()
        if joining is None:
            delta = flatten(
                [o - m.to(o.device, torch.float32) for o, m in zip(self.outer_params, masters)]
            )
        else:  # a joiner trained nothing from the live islands' theta_outer
            delta = torch.zeros(sum(self.numels))
        if self.residual is not None:  # error feedback: what earlier steps did not send
            delta += self.residual
        fresh = delta.clone() if self.mode == "delayed" else None  # fp32 all-reduces in place
        outcome = self.membership.run_round(
            self.outer_step, partial(self._round, delta, fresh, step, final), joining, final)
        exchange, late = outcome.exchange, outcome.late
        if self.residual is not None:
            self.residual = delta - exchange.sent
            fresh = None if fresh is None else exchange.sent  # delayed: its share is what it sent
        del delta
        metrics = {"outer_step": self.outer_step, **self.membership.metrics()}
        applied = [e for e in (late, exchange if final or self.mode == "sync" else None)
                   if e is not None]
        self._waited([late] if late is not None else [])
        self._apply(outcome.gradient)
        if self.mode == "delayed":
            # after the last step nothing is in flight: a run extended past it starts its pipeline
            # afresh
            self.previous, self.pending = (
                (torch.zeros_like(fresh), None) if final else (fresh, exchange)
            )
            self.previous_share = outcome.contributors
            self.contributed = joining is None  # to the exchange now in flight
            if final:
                exchange.bytes_sent += self._average_islands()
        self.joined_step = outcome.step
        self._write(self.outer_params)
        metrics.update(self._exchange_metrics(exchange, applied, final))
        metrics["outer_seconds"] = time.perf_counter() - start
        return metrics

    def _round(self, delta: torch.Tensor, fresh: Optional[torch.Tensor], step: int, final: bool,
               members: list[int], group, joiners: list[int]) -> RoundOutcome:
        """One attempt at the exchange among this outer step's members (retried by an elastic
        membership without an island lost during it); delayed, also the late average and the
        eager gradient. Joiners take the shared state. Nothing is applied here."""
        late = self._late_average(group, members) if self.mode == "delayed" else None
        contributors = len(members) - len(joiners)
        exchange = self.exchange(delta.clone(), group, len(members), contributors)
        at_step = step
        if self.mode == "sync":
            gradient = exchange.result()
        else:  # top-k: this island's share is what it sent
            share = fresh if exchange.sent is None else exchange.sent
            gradient = self.eager_gradient(share, late, exchange, final, contributors)
        if joiners:  # sync: the joiner's own average is the same
            shared = None if self.mode == "sync" else gradient
            at_step, shared = self._share_state(group, members, joiners, step, shared)
            gradient = exchange.result() if shared is None else shared
        self.membership.publish(self.outer_step, at_step, self.shape())
        self.group = group
        return RoundOutcome(exchange, late, gradient, contributors, at_step)

    def _exchange_metrics(self, exchange: Exchange, applied: list, final: bool) -> dict:
        """An outer step's bytes, errors, norms and times, over the island's ranks (one small
        all-reduce); `applied`: the exchanges whose averages this step applied. The peak leaves
        out the last step, which sends everything at once by design."""
        metrics = {}
        sums = [exchange.error_sq, exchange.norm_sq]
        norm_sq = self._norm_sq(applied[-1].result()) if applied else 0.0
        sums.append(norm_sq)
        if self.config.checksum:
            sums += self.weights.fingerprint() + self._outer_fingerprint()
        if self.residual is not None:
            sums.append(self._norm_sq(self.residual))
        sums = all_reduce_values(sums, dist.ReduceOp.SUM)
        bytes_max = all_reduce_values([float(exchange.bytes_sent)], dist.ReduceOp.MAX)[0]
        if not final:
            self.peak_bytes = max(self.peak_bytes, int(bytes_max))
        metrics.update(outer_bytes_sent=int(bytes_max), outer_peak_bytes=self.peak_bytes,
                       outer_payload_bytes=exchange.payload_bytes)
        if self.config.compress != "none":
            metrics["outer_compress_error"] = math.sqrt(sums[0] / sums[1]) if sums[1] > 0 else 0.0
        if self.residual is not None:
            metrics["outer_residual_norm"] = math.sqrt(sums[-1])
        if applied:
            metrics["outer_grad_norm"] = math.sqrt(sums[2])
            metrics["outer_comm_seconds"] = sum(e.seconds for e in applied)
            if self.mode == "delayed":
                metrics["outer_comm_hidden_seconds"] = sum(e.hidden_seconds for e in applied)
                metrics["outer_wait_seconds"] = sum(e.blocked for e in applied)
        if self.config.checksum:
            metrics.update(
                weights_sum=sums[3], weights_sumsq=sums[4], outer_sum=sums[5], outer_sumsq=sums[6]
            )
        return metrics

    # -------------------------------------------------------------- pieces

    def exchange(self, delta: torch.Tensor, group, islands: int, contributors=None,
                 numels: Optional[list[int]] = None, then=None) -> Exchange:
        """Start the exchange among `islands` (the group's size); the average divides by the
        `contributors` (default all: an elastic joiner adds zeros); `numels`: the tensors in
        `delta` (default this rank's master tensors); delayed, on the exchange thread, which
        calls `then(ready_after)` once the average is ready."""
        return Exchange(delta, group, islands, self.codec, numels or self.numels,
                        measure_bytes=self.mode == "sync", contributors=contributors,
                        background=self.background, then=then)

    def _waited(self, exchanges: list) -> None:
        """Exchanges just applied a window after they started: any that an inner step waited
        for tells the link watch."""
        for exchange in exchanges:
            if exchange.blocked > 0:
                self.link.waited(exchange)

    def _adopt_island0_weights(self) -> None:
        """Every island starts from island 0's weights (rank r of each island holds the same shard).
        """
        if self.islands > 1 and self.group is not None:
            flat = flatten(self.weights.tensors())
            self.group.broadcast(flat, 0).wait()
            self._write(flat.split(self.numels))

    def eager_gradient(
        self, own: torch.Tensor, late, exchange: Exchange, final: bool, contributors: int
    ) -> torch.Tensor:
        """Kale et al.'s eager outer gradient: the late average with this island's share of it
        swapped for its fresh one (at the last step, for the whole fresh average)."""
        late = late.result() if late is not None else torch.zeros_like(own)
        fresh = exchange.result() if final else own / contributors
        return late - self.previous / self.previous_share + fresh

    def _average_islands(self) -> int:
        """theta_outer averaged over the islands (each stepped its own momentum); returns bytes
        sent.
        """
        islands = len(self.membership.members)
        if islands == 1:
            return 0
        average = Exchange(flatten(self.outer_params), self.group, islands, Codec(), self.numels)
        with torch.no_grad():
            for p, a in zip(self.outer_params, average.result().split(self.numels)):
                p.copy_(a.view_as(p))
        return average.bytes_sent

    def _apply(self, average: torch.Tensor) -> None:
        """One outer optimizer step on theta_outer with `average` as its gradient."""
        for p, g in zip(self.outer_params, average.split(self.numels)):
            p.grad = g.view_as(p).to(self.device)
        self.optimizer.step()
        for p in self.outer_params:
            p.grad = None

    @torch.no_grad()
    def _write(self, values) -> None:
        """theta into the fp32 master weights, then into the module's working weights."""
        for m, v in zip(self.weights.tensors(), values):
            m.copy_(v.view_as(m))
        self.weights.publish()

    def _counted(self, flat: torch.Tensor) -> torch.Tensor:
        """`flat` (over this rank's master tensors) without the copies another rank counts."""
        offsets = [0]
        for n in self.numels:
            offsets.append(offsets[-1] + n)
        excluded = getattr(self.weights, "excluded", [])
        if not excluded:
            return flat
        keep = torch.ones(flat.numel(), dtype=torch.bool)
        for k, start, numel in excluded:
            keep[offsets[k] + start : offsets[k] + start + numel] = False
        return flat[keep]

    def _norm_sq(self, flat: torch.Tensor) -> float:
        """This rank's share of the squared norm of a flat pseudo-gradient (copies counted once)."""
        counted = self._counted(flat)
        return float(torch.dot(counted, counted)) / getattr(self.weights, "replicas", 1)

    def _outer_fingerprint(self) -> list[float]:
        """[sum, sum of squares] in float64 of theta_outer on this rank, copies counted once."""
        counted = self._counted(self._outer_flat()).double()
        return [float(counted.sum()), float(counted.pow(2).sum())]

    def _outer_flat(self) -> torch.Tensor:
        """theta_outer as one vector over this rank's master tensors."""
        return torch.cat([p.detach().reshape(-1) for p in self.outer_params])

    # -------------------------------------------------------------- checkpoints


def membership_for(config: DiLoCoConfig, topology: Topology) -> Union[FixedGroup, ElasticIslands]:
    """Elastic islands with --diloco_elastic, else every island in every outer step."""
    if not config.elastic:
        return FixedGroup(topology)
    return ElasticIslands(topology, config.quorum_timeout, config.min_islands, topology.timeout_s)
