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
dragon.diloco.fragments.FragmentedDiLoCo (dragon.diloco.build chooses between them). Codecs:
dragon.diloco.codecs; metrics: dragon.diloco.metrics.

Inner optimizer state, LR schedule and data stream stay per island, as in DiLoCo.

Elastic (--diloco_elastic): each outer step averages over the islands that reach it
(dragon.diloco.membership), outer_quorum records how many; an island
lost during the exchange is left out of a retry. The average is over the members only, so a
lone island steps on its own Delta. Delayed: an average in flight that failed (an island died
during it) is redone at the next outer step from the survivors' kept Deltas, so the late average
is the survivors' average.
"""


import time
from functools import partial
from typing import Callable, Optional

import torch

from dragon.diloco.codecs import Codec
from dragon.diloco.config import DiLoCoConfig
from dragon.diloco.exchange import (AnyExchange, Exchange, FinishedExchange, RoundOutcome,
                                    flatten)
from dragon.diloco.runtime import OuterRuntime, resumable_state
from dragon.diloco.state import STATE_FILE, STATE_VERSION, check_fits, diloco_state_for
from dragon.parallel.topology import Topology

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


class DiLoCo:
    """The outer loop of one rank: call maybe_outer_step(step) after every inner step.

    `weights` is a MasterWeights (or anything with tensors(), publish(), replicas, excluded and
    fingerprint()); `outer_optimizer(params)` builds any torch optimizer over theta_outer.
    """

    def __init__(self, weights, config: DiLoCoConfig, topology: Topology,
                 outer_optimizer: Optional[OptimizerFactory] = None):
        self.runtime = OuterRuntime(weights, config, topology)
        self.weights, self.config, self.topology = weights, config, topology
        self.H, self.mode, self.islands = config.inner_steps, config.mode, topology.islands
        self.numels, self.membership = self.runtime.numels, self.runtime.membership
        device = self.runtime.device
        self.outer_params = [m.detach().to(device, torch.float32, copy=True)
                             for m in weights.tensors()]
        self._make_optimizer = outer_optimizer or config.outer_optimizer
        self.optimizer = self._make_optimizer(self.outer_params)
        # delayed: this island's pseudo-gradient in flight, and the exchange carrying it
        self.previous = torch.zeros(sum(self.numels)) if self.mode == "delayed" else None
        self.pending: Optional[AnyExchange] = None
        self.previous_share = self.islands  # what the late average divided `previous` by
        # top-k: what this rank has not sent yet, added to its next pseudo-gradient
        self.residual = torch.zeros(sum(self.numels)) if config.compress == "topk" else None
        self.contributed = True  # `previous` is this island's share of it
        self.outer_step = self.joined_step = 0

    def is_boundary(self, step: int, final: bool = False) -> bool:
        """Whether a checkpoint may be taken after inner step `step`."""
        return step % self.H == 0 or final

    def maybe_outer_step(self, step: int, final: bool = False) -> dict:
        """After inner step `step` (1-based): the outer step when one is due, with its metrics; else
        {}. `final` makes the last step an outer step and, in delayed mode, applies what is in
        flight."""
        return self.runtime.run(step, final, self.is_boundary, self._outer_step)

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
        exchange, late_average = outcome.exchange, outcome.late_average
        if self.residual is not None:
            self.residual = delta - exchange.sent
            fresh = None if fresh is None else exchange.sent  # delayed: its share is what it sent
        del delta
        metrics = {"outer_step": self.outer_step, **self.membership.metrics()}
        applied = [e for e in (late_average, exchange if final or self.mode == "sync" else None)
                   if e is not None]
        self.runtime.waited([late_average] if late_average is not None else [])
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
        self.runtime.write(self.outer_params)
        metrics.update(self.runtime.report.of_step(exchange, applied, final, self.residual,
                                           self._outer_flat))
        metrics["outer_seconds"] = time.perf_counter() - start
        return metrics

    def _round(self, delta: torch.Tensor, fresh: Optional[torch.Tensor], step: int, final: bool,
               members: list[int], group, joiners: list[int]) -> RoundOutcome:
        """One attempt at the exchange among this outer step's members (retried by an elastic
        membership without an island lost during it); delayed, also the late average and the
        eager gradient. Joiners take the shared state. Nothing is applied here."""
        late_average = self._late_average(group, members) if self.mode == "delayed" else None
        contributors = len(members) - len(joiners)
        exchange = self.runtime.exchange(delta.clone(), group, len(members), contributors)
        at_step = step
        if self.mode == "sync":
            gradient = exchange.result()
        else:  # top-k: this island's share is what it sent
            share = fresh if exchange.sent is None else exchange.sent
            gradient = self.eager_gradient(share, late_average, exchange, final, contributors)
        if joiners:  # sync: the joiner's own average is the same
            shared = None if self.mode == "sync" else gradient
            at_step, shared = self.runtime.share_outer_state(
                group, members, joiners, step, self.outer_params, self.outer_optimizer_state(),
                self.load_outer_optimizer_state, gradient=shared)
            gradient = exchange.result() if shared is None else shared
        self.membership.publish(self.outer_step, at_step, self.runtime.shape())
        self.runtime.group = group
        return RoundOutcome(exchange, late_average, gradient, contributors, at_step)

    # -------------------------------------------------------------- pieces

    def eager_gradient(
        self, fresh_share: torch.Tensor, late_average: Optional[AnyExchange], exchange: Exchange,
        final: bool, contributors: int
    ) -> torch.Tensor:
        """Kale et al.'s eager outer gradient: the late average with this island's share of it
        swapped for its fresh one (at the last step, for the whole fresh average)."""
        late = late_average.result() if late_average is not None else torch.zeros_like(fresh_share)
        fresh = exchange.result() if final else fresh_share / contributors
        return late - self.previous / self.previous_share + fresh

    def _average_islands(self) -> int:
        """theta_outer averaged over the islands (each stepped its own momentum); returns bytes
        sent.
        """
        islands = len(self.membership.members)
        if islands == 1:
            return 0
        average = Exchange(flatten(self.outer_params), self.runtime.group, islands, Codec(),
                           self.numels)
        with torch.no_grad():
            for p, a in zip(self.outer_params, average.result().split(self.numels)):
                p.copy_(a.view_as(p))
        return average.bytes_sent

    def _apply(self, average: torch.Tensor) -> None:
        """One outer optimizer step on theta_outer with `average` as its gradient."""
        for p, g in zip(self.outer_params, average.split(self.numels)):
            p.grad = g.view_as(p).to(self.runtime.device)
        self.optimizer.step()
        for p in self.outer_params:
            p.grad = None

    def _outer_flat(self) -> torch.Tensor:
        """theta_outer as one vector over this rank's master tensors."""
        return torch.cat([p.detach().reshape(-1) for p in self.outer_params])

    # -------------------------------------------------------------- elastic islands

    def join(self) -> tuple[int, dict]:
        """--diloco_join: wait to be let into the live islands' next outer step, take
        theta_outer, the outer optimizer's state and the step from them, and take that outer step
        with them (sync: their average; delayed: the gradient their first island applies), ending
        it on their weights. Returns the step and the outer step's metrics."""
        target, quorum = self.membership.admit(self.runtime.shape())
        self.outer_step = target - 1
        for stale in (self.previous, self.residual):  # what this island's checkpoint had
            if stale is not None:
                stale.zero_()
        self.pending, self.contributed = None, False
        metrics = self._outer_step(0, False, joining=quorum)
        return self.joined_step, metrics

    def close(self, ended_at: Optional[int] = None) -> None:
        """After the last outer step (dragon.diloco.runtime.OuterRuntime.close)."""
        self.runtime.close(ended_at)

    def _late_average(self, group, members: list[int]) -> Optional[AnyExchange]:
        """Delayed: the average in flight since the last outer step. When it failed on any member
        (an island died during it), the members redo it from their kept pseudo-gradients: the late
        average is then the survivors' average."""
        exchanges = [] if self.pending is None else [self.pending]
        contributors = self.membership.failed(
            self.outer_step, "the average in flight since the last outer step", exchanges,
            self.contributed, group)
        if contributors is None:
            return self.pending
        self.previous_share = contributors
        redo = self.runtime.exchange(self.previous.clone(), group, len(members), contributors)
        redo.result()
        return redo

    def outer_optimizer_state(self) -> dict:
        return self.optimizer.state_dict()

    def load_outer_optimizer_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    # -------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        """theta_outer, the outer optimizer, the outer step and (delayed) this island's last
        pseudo-gradient and the average in flight (waited for here: the save point is the same on
        every island)."""
        try:
            pending = self.pending.result().clone() if self.pending is not None else None
        except RuntimeError:  # elastic: an island died during it; the next outer step redoes it
            pending = "lost"
        return {
            "version": STATE_VERSION, "outer_step": self.outer_step, "mode": self.mode,
            "numels": self.numels,
            # the partition, for dragon.checkpoint.reshape
            "segments": getattr(self.weights, "segments", lambda: None)(),
            "neuron_share": getattr(self.weights, "neuron_share", lambda: (0, 1))(),
            "outer_params": [p.detach().cpu().clone() for p in self.outer_params],
            "optimizer": self.optimizer.state_dict(),
            "previous": None if self.previous is None else self.previous.clone(),
            "residual": None if self.residual is None else self.residual.clone(),
            "pending": pending,
            "previous_share": self.previous_share,
            "contributed": self.contributed,
            "peak_bytes": self.runtime.report.peak_bytes,
        }

    def load_state_dict(self, state: dict) -> None:
        """This rank's state as it saved it; every island must resume the same outer step."""
        self.runtime.check_same_step(state["outer_step"], "outer steps")
        self._load(state)

    def resume_elsewhere(self, saved) -> None:
        """Resume from a checkpoint that holds no state of this rank as it is now
        (dragon.checkpoint.checkpointer.Saved): one saved on another partition of the weights
        (laid out again for this one), island 0's (a new island: no share of its own in the
        average in flight), or one of a run without DiLoCo (the outer loop starts afresh)."""
        self.runtime.check_same_step(saved.step)
        state = resumable_state(saved, STATE_FILE, lambda tag_dir: diloco_state_for(
            tag_dir, self.weights, self.numels))
        if state is None:
            self.restart()
            return
        self._load(state)
        if saved.borrowed:
            self.forget_own_share()

    def _load(self, state: dict) -> None:
        check_fits(state, 1, self.mode, self.numels)
        with torch.no_grad():
            for p, saved in zip(self.outer_params, state["outer_params"]):
                p.copy_(saved)
            if self.previous is not None:
                self.previous.copy_(state["previous"])
            if self.residual is not None and state.get("residual") is not None:
                self.residual.copy_(state["residual"])
            elif self.residual is not None:  # a run without top-k until now
                self.residual.zero_()
        self.optimizer.load_state_dict(state["optimizer"])
        self.outer_step = state["outer_step"]
        pending = state["pending"]
        self.pending = None if pending is None else FinishedExchange(
            None if isinstance(pending, str) else pending)
        self.previous_share = state.get("previous_share", self.islands)
        self.contributed = state.get("contributed", True)
        self.runtime.report.peak_bytes = state.get("peak_bytes", 0)

    def forget_own_share(self) -> None:
        """A new island resumed from island 0's state has no pseudo-gradient of its own in the
        average in flight, nor anything of its own held back (top-k)."""
        for vector in (self.previous, self.residual):
            if vector is not None:
                vector.zero_()
        self.contributed = False

    def restart(self) -> None:
        """Start the outer loop afresh from the current weights (a checkpoint saved without DiLoCo).
        """
        self.runtime.adopt_island0_weights()
        masters = self.weights.tensors()
        with torch.no_grad():
            for p, m in zip(self.outer_params, masters):
                p.copy_(m)
            for vector in (self.previous, self.residual):
                if vector is not None:
                    vector.zero_()
        self.optimizer = self._make_optimizer(self.outer_params)
        self.pending, self.outer_step = None, 0
