"""Streaming DiLoCo (Douillard et al., 2025) for BDH: the weights in F fragments that meet in
turn, so that the bytes of an outer step are spread over the window instead of sent at once.

The cut into fragments: dragon.diloco.fragment_cut.

The schedule. Fragment f syncs at inner steps floor(f H/F) + kH: its pseudo-gradient Delta_f =
theta_outer_f - theta_f is averaged over the islands (any codec of dragon.diloco.exchange, top-k
with its error feedback included) and fragment f's own outer optimizer steps theta_outer_f. sync:
the exchange blocks and theta_f becomes theta_outer_f. delayed: the exchange runs on the exchange
thread (dragon.diloco.background) under the next `fragment_delay` inner steps (at most H//F, so one
fragment is in flight at a time), or, with `auto`, until it is done on every island and at most H
steps (dragon.diloco.landing), and lands then: theta_f <- alpha theta_f + (1 - alpha)
theta_outer_f, the paper's merge of the local progress made meanwhile. The merge, not the eager
update of dragon's delayed mode, because the fragment lands inside its own window: eager updates
need the late average of the window before, and the merge keeps theta_outer one shared value that
every island steps with the same average (bit-identical theta_outer on every island after every
landing). The last step lands what is in flight and syncs every fragment at once, blocking, so
training ends with every island on the same weights. Elastic islands (--diloco_elastic): each event
of the schedule is a round among the islands that reach it, in delayed mode with a fixed delay
(auto: one step). Sync mode: the fragments that sync exchange and land in the round. Delayed mode:
a fragment's exchange starts in the round of its sync and lands `fragment_delay` inner steps later,
in a round of its own. An island that dies in between leaves that exchange failed on the others:
the landing round finds so (one small all-reduce among its members) and the members redo the
exchange among themselves from the pseudo-gradients each kept, divided by those of them that
contributed to it, as the whole model's late average is redone (dragon.diloco.outer). A joiner
first takes theta_outer, every fragment's outer optimizer and the step from a live island, and
every fragment's weights from theta_outer (it sends zeros); a landing round with a joiner redoes
the landing among all its members, so that the joiner applies the same average as the others.
Averages are applied only once the round succeeds.
"""

import time
from typing import Optional

import torch

from dragon.diloco.exchange import (Exchange, ExchangeSet, FinishedExchange, broadcast_object,
                                    flatten)
from dragon.diloco.landing import AUTO, AutoLandings, InFlight
from dragon.diloco.config import DiLoCoConfig
from dragon.diloco.outer import OptimizerFactory
from dragon.diloco.runtime import OuterRuntime, resumable_state
from dragon.diloco.fragment_cut import INTERLEAVED, RUNS, fragment_ids
from dragon.diloco.state import STATE_FILE, STATE_VERSION, check_fits, fragment_state_for
from dragon.parallel.topology import Topology

class FragmentedDiLoCo:
    """The outer loop of one rank with --diloco_fragments F > 1 (see the module's docstring);
    call maybe_outer_step(step) after every inner step, as with DiLoCo. `ids`: the fragment of
    each of this rank's values (default: BDH's cut, from the weights' segments and shapes)."""

    def __init__(self, weights, config: DiLoCoConfig, topology: Topology,
                 outer_optimizer: Optional[OptimizerFactory] = None,
                 ids: Optional[torch.Tensor] = None):
        self.runtime = OuterRuntime(weights, config, topology)
        self.weights, self.config, self.topology = weights, config, topology
        self.H, self.mode, self.islands = config.inner_steps, config.mode, topology.islands
        self.numels, self.membership = self.runtime.numels, self.runtime.membership
        self.F, self.delay = config.fragments, config.fragment_delay
        self.alpha = config.fragment_alpha if self.mode == "delayed" else 0.0
        self.cut = INTERLEAVED
        if ids is None:
            ids = fragment_ids(weights.segments(), weights.shapes(), self.numels, self.F)
        self.ids = ids  # one byte a value; a fragment's mask is made when it is used
        whole = flatten(weights.tensors())
        # theta_outer as one flat tensor per fragment, each with its own outer optimizer
        self.outer_params = [whole[self.mask(f)].to(self.runtime.device) for f in range(self.F)]
        self._make_optimizer = outer_optimizer or config.outer_optimizer
        self.optimizers = [self._make_optimizer([p]) for p in self.outer_params]
        # top-k: what this rank has not sent yet, added to its next pseudo-gradient
        self.residual = torch.zeros(sum(self.numels)) if config.compress == "topk" else None
        self.outer_step = self.joined_step = 0
        self.in_flight: dict[int, InFlight] = {}
        self.auto = None  # --diloco_fragment_delay auto: the landings agreed in the store
        if self.delay == AUTO:
            if self.runtime.background is not None:
                self.auto = AutoLandings(topology, self.runtime.background, self.H)
            self.delay = 1  # one island has no link to wait for

    def is_boundary(self, step: int, final: bool = False) -> bool:
        """Whether a checkpoint may be taken after inner step `step`."""
        return step % self.H == 0 or final

    def maybe_outer_step(self, step: int, final: bool = False) -> dict:
        """After inner step `step`: the syncs and landings due then, with their metrics."""
        return self.runtime.run(step, final, self.is_due, self._outer_step)

    def close(self, ended_at: Optional[int] = None) -> None:
        """After the last outer step (dragon.diloco.runtime.OuterRuntime.close)."""
        self.runtime.close(ended_at)

    def mask(self, fragment: int) -> torch.Tensor:
        """Which of this rank's values (over all its master tensors) are in `fragment`."""
        return self.ids == fragment

    def _outer_flat(self) -> torch.Tensor:
        whole = torch.zeros(sum(self.numels))
        for f, p in enumerate(self.outer_params):
            whole[self.mask(f)] = p.detach()
        return whole

    def offset(self, fragment: int) -> int:
        return fragment * self.H // self.F

    def syncing(self, step: int, final: bool) -> list[int]:
        """The fragments that sync after inner step `step` (at the last step, all)."""
        if final:
            return list(range(self.F))
        return [f for f in range(self.F) if step >= max(self.offset(f), 1)
                and step % self.H == self.offset(f)]

    def landing(self, step: int, final: bool) -> list[int]:
        if self.auto is not None and not final:
            for f, x in self.in_flight.items():
                self.auto.decide(f, x, step)
        return sorted(f for f, x in self.in_flight.items()
                      if final or (x.lands_at is not None and x.lands_at <= step))

    def is_due(self, step: int, final: bool) -> bool:
        return bool(self.syncing(step, final) or self.landing(step, final))

    def _outer_step(self, step: int, final: bool, joining=None) -> dict:
        if self.config.elastic:
            return self._elastic_step(step, final, joining)
        start = time.perf_counter()
        self.outer_step += 1
        landed = self.landing(step, final)
        flights = [self.in_flight.pop(f) for f in landed]
        arrived = [x.exchange for x in flights]
        averages = {f: self._step_fragment(f, x.result()) for f, x in zip(landed, arrived)}
        self.runtime.waited([x.exchange for x in flights if x.lands_at == x.synced_at + self.H])
        self._write_fragments(landed, self.alpha)
        syncing = self.syncing(step, final)
        started = self._start(syncing, self.runtime.group, self.islands, step=0 if final else step)
        if self.mode == "sync" or final:  # blocking: each lands now, theta_f = theta_outer_f
            arrived += started
            averages.update({f: self._step_fragment(f, x.result())
                             for f, x in zip(syncing, started)})
            self._write_fragments(syncing, 0.0)
        else:
            lands_at = None if self.auto else step + self.delay
            self.in_flight.update({f: InFlight(x, lands_at, step)
                                   for f, x in zip(syncing, started)})
        metrics = {"outer_step": self.outer_step}
        if syncing:  # one fragment a step; F: all of them (the last step)
            metrics["outer_fragment"] = self.F if final else syncing[0]
        if averages:
            metrics["outer_landed"] = self.F if final else min(averages)
        if flights and not final:
            metrics["outer_landed_after"] = step - flights[0].synced_at
        applied = [ExchangeSet(arrived, self._placed(averages))] if averages else []
        metrics.update(self.runtime.report.of_step(ExchangeSet(started), applied, final,
                                                   self.residual, self._outer_flat))
        metrics["outer_seconds"] = time.perf_counter() - start
        return metrics

    # ----------------------------------------------------------- pieces

    def _start(self, fragments: list[int], group, islands: int, contributors=None,
               keep_back: bool = True, step: int = 0, sent_deltas: Optional[list] = None
               ) -> list[Exchange]:
        """Start the exchanges of theta_outer_f - theta_f (plus what top-k kept back) of these
        fragments among `islands`, in flight after inner step `step` (0: none lands later);
        `keep_back`: top-k keeps what it did not send at once (an elastic round does so once it
        succeeds); `sent_deltas`: gets a copy of each pseudo-gradient (an elastic island redoes a
        failed exchange from it)."""
        if not fragments:
            return []
        local, started = flatten(self.weights.tensors()), []
        for f in fragments:
            delta = self._delta(f, local)
            if sent_deltas is not None:
                sent_deltas.append(delta.clone())
            then = self.auto.poster(f, step) if self.auto and step else None
            started.append(self.runtime.exchange(delta, group, islands, contributors,
                                                 [delta.numel()], then))
            if keep_back and self.residual is not None:
                self.residual[self.mask(f)] = delta - started[-1].sent
        return started

    def _delta(self, fragment: int, local: torch.Tensor) -> torch.Tensor:
        """theta_outer_f - theta_f, plus what top-k kept back of fragment f (`local`: this rank's
        weights, flat)."""
        mask = self.mask(fragment)
        delta = self.outer_params[fragment].to("cpu", torch.float32) - local[mask]
        if self.residual is not None:
            delta += self.residual[mask]
        return delta

    def _decided(self, fragment: int, x: InFlight) -> InFlight:
        """x with its landing step decided (auto: waiting for its exchange, as a save does)."""
        if self.auto is not None:
            self.auto.decide(fragment, x, self.runtime.background.clock, waiting=True)
        return x

    def outer_optimizer_state(self) -> list:
        return [o.state_dict() for o in self.optimizers]

    def load_outer_optimizer_state(self, state: list) -> None:
        for optimizer, saved in zip(self.optimizers, state):
            optimizer.load_state_dict(saved)

    def _step_fragment(self, fragment: int, average: torch.Tensor) -> torch.Tensor:
        """Fragment `fragment`'s outer optimizer steps on theta_outer_f with `average`."""
        p = self.outer_params[fragment]
        p.grad = average.to(p.device)
        self.optimizers[fragment].step()
        p.grad = None
        return average

    def _write_fragments(self, fragments: list[int], alpha: float) -> None:
        """theta_f <- alpha theta_f + (1 - alpha) theta_outer_f for these fragments, into the
        master and working weights."""
        if not fragments:
            return
        flat = flatten(self.weights.tensors())
        for f in fragments:
            outer = self.outer_params[f].to("cpu", torch.float32)
            if alpha:
                outer = alpha * flat[self.mask(f)] + (1 - alpha) * outer
            flat[self.mask(f)] = outer
        self.runtime.write(flat.split(self.numels))

    def _placed(self, averages: dict) -> torch.Tensor:
        """The averages that landed, in their places among all of this rank's values (0
        elsewhere)."""
        whole = torch.zeros(sum(self.numels))
        for f, average in averages.items():
            whole[self.mask(f)] = average
        return whole

    # ----------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        """theta_outer and the outer optimizer of every fragment, the averages in flight (waited
        for here: the save point is the same on every island) and where they land."""
        return {
            "version": STATE_VERSION, "outer_step": self.outer_step, "mode": self.mode,
            "numels": self.numels, "fragments": self.F, "cut": self.cut,
            "segments": self.weights.segments(),  # the partition, for a resume on another
            "neuron_share": self.weights.neuron_share(),
            "outer_params": [p.detach().cpu().clone() for p in self.outer_params],
            "optimizers": self.outer_optimizer_state(),
            "residual": None if self.residual is None else self.residual.clone(),
            "in_flight": {f: self._saved_flight(f, x) for f, x in self.in_flight.items()},
            "peak_bytes": self.runtime.report.peak_bytes,
        }

    def _saved_flight(self, fragment: int, x: InFlight) -> tuple:
        """(its average, where it lands, where it synced, the kept pseudo-gradient, whether it is
        this island's own) of an exchange in flight; the average is "lost" when an elastic
        island died during it (its landing redoes it from the kept pseudo-gradients)."""
        try:
            average = self._decided(fragment, x).exchange.result().clone()
        except RuntimeError:
            average = "lost"
        return average, x.lands_at, x.synced_at, x.delta, x.contributed

    def _load(self, state: dict) -> None:
        check_fits(state, self.F, self.mode, self.numels)
        if state.get("cut", RUNS) != self.cut:  # saved before the cut was interleaved
            self.cut = state.get("cut", RUNS)
            self.ids = fragment_ids(self.weights.segments(), self.weights.shapes(), self.numels,
                                    self.F, self.cut)
        with torch.no_grad():
            for p, saved in zip(self.outer_params, state["outer_params"]):
                p.copy_(saved)
            if self.residual is not None:
                self.residual.copy_(state["residual"])
        self.load_outer_optimizer_state(state["optimizers"])
        self.outer_step, self.runtime.report.peak_bytes = state["outer_step"], state["peak_bytes"]
        self.in_flight = {f: InFlight(FinishedExchange(
            None if isinstance(average, str) else average),
                                       at, *synced)
                          for f, (average, at, *synced) in state["in_flight"].items()}

    def load_state_dict(self, state: dict) -> None:
        """This rank's state as it saved it; every island must resume the same outer step."""
        self.runtime.check_same_step(state["outer_step"], "outer steps")
        self._load(state)

    def resume_elsewhere(self, saved) -> None:
        """As DiLoCo.resume_elsewhere: a state laid out for this partition, or island 0's (a new
        island: nothing of its own held back), or none (the outer loop starts afresh)."""
        self.runtime.check_same_step(saved.step)
        state = resumable_state(saved, STATE_FILE, lambda tag_dir: fragment_state_for(
            tag_dir, self.weights, self.numels, self.F))
        if state is None:
            self.restart()
            return
        self._load(state)
        if saved.borrowed and self.residual is not None:
            self.residual.zero_()

    def restart(self) -> None:
        """Start afresh from the current weights (a checkpoint saved without DiLoCo)."""
        self.runtime.adopt_island0_weights()
        whole = flatten(self.weights.tensors())
        with torch.no_grad():
            for f, p in enumerate(self.outer_params):
                p.copy_(whole[self.mask(f)])
        if self.residual is not None:
            self.residual.zero_()
        self.optimizers = [self._make_optimizer([p]) for p in self.outer_params]
        self.in_flight, self.outer_step = {}, 0

    # ----------------------------------------------------------- elastic islands

    def join(self) -> tuple[int, dict]:
        """--diloco_join: as DiLoCo.join; what this island's checkpoint had in flight or held
        back is the live islands' now."""
        target, quorum = self.membership.admit(self.runtime.shape())
        self.outer_step, self.in_flight = target - 1, {}
        if self.residual is not None:
            self.residual.zero_()
        metrics = self._outer_step(0, False, joining=quorum)
        return self.joined_step, metrics

    def _elastic_step(self, step: int, final: bool, joining=None) -> dict:
        """An event of the schedule among the islands that reach it. The last step of a delayed
        run first lands what is in flight, in a round of its own, then syncs every fragment from
        the weights that landing left."""
        if self.mode == "delayed" and final and self.in_flight:
            self._elastic_event(step, final, joining, sync=False)
            joining = None
        return self._elastic_event(step, final, joining)

    def _elastic_event(self, step: int, final: bool, joining=None, sync: bool = True) -> dict:
        """One round: land what is due (delayed), then start (delayed) or exchange and land (sync,
        and the last step) what syncs (`sync` False: nothing)."""
        start = time.perf_counter()
        self.outer_step += 1
        blocking = self.mode == "sync" or final

        def attempt(members: list[int], group, joiners: list[int]):
            at_step, due = step, self.landing(step, final)
            if joiners:
                at_step, _ = self.runtime.share_outer_state(
                    group, members, joiners, step, self.outer_params,
                    self.outer_optimizer_state(), self.load_outer_optimizer_state)
                root = members.index(min(i for i in members if i not in joiners))
                due = broadcast_object(due, group, root)
                if self.topology.island in joiners:
                    self._write_fragments(list(range(self.F)), 0.0)
            landed = self._land(due, group, members, bool(joiners))
            syncing, sent_deltas = self.syncing(at_step, final) if sync else [], []
            started = self._start(syncing, group, len(members), len(members) - len(joiners),
                                  keep_back=False, sent_deltas=None if blocking else sent_deltas)
            synced = {f: x.result() for f, x in zip(syncing, started)} if blocking else {}
            self.membership.publish(self.outer_step, at_step, self.runtime.shape())
            self.runtime.group = group
            contributes = self.topology.island not in joiners
            return due, landed, syncing, started, synced, sent_deltas, contributes, at_step

        due, landed, syncing, started, synced, sent_deltas, contributes, self.joined_step = \
            self.membership.run_round(self.outer_step, attempt, joining, final)
        flights = [self.in_flight.pop(f) for f in due if f in self.in_flight]
        if self.residual is not None:  # what top-k did not send, now that the round succeeded
            local = flatten(self.weights.tensors())
            for f, x in zip(syncing, started):
                self.residual[self.mask(f)] = self._delta(f, local) - x.sent
        averages = {f: self._step_fragment(f, landed[f]) for f in sorted(landed)}
        self._write_fragments(sorted(landed), self.alpha)
        averages.update({f: self._step_fragment(f, a) for f, a in synced.items()})
        self._write_fragments(sorted(synced), 0.0)
        at = self.joined_step  # a joiner's step is the live islands'
        self.in_flight.update({f: InFlight(x, at + self.delay, at, delta, contributes)
                               for f, x, delta in zip(syncing, started, sent_deltas)})
        metrics = {"outer_step": self.outer_step,
                   "outer_quorum": len(self.membership.members)}
        if syncing:
            metrics["outer_fragment"] = self.F if final else syncing[0]
        if averages:
            metrics["outer_landed"] = self.F if final else min(averages)
        if flights and not final:
            metrics["outer_landed_after"] = step - flights[0].synced_at
        exchanges = [x.exchange for x in flights] + (started if blocking else [])
        applied = [ExchangeSet(exchanges, self._placed(averages))] if averages else []
        metrics.update(self.runtime.report.of_step(ExchangeSet(started), applied, final,
                                                   self.residual, self._outer_flat))
        metrics["outer_seconds"] = time.perf_counter() - start
        return metrics

    def _land(self, due: list[int], group, members: list[int], redo: bool) -> dict:
        """The averages of the fragments `due` to land: their exchanges' results, or, when one
        failed on any member (or `redo`: a joiner is in the round), the exchanges redone among
        `members` from the kept pseudo-gradients (a joiner's: zeros), divided by the members that
        contributed to them."""
        if not due:
            return {}
        flights = [self.in_flight.get(f) for f in due]
        exchanges = [x.exchange for x in flights if x is not None]
        contributed = all(x is not None and x.contributed for x in flights)
        share = self.membership.failed(
            self.outer_step, f"the exchange of fragment(s) {due} in flight", exchanges,
            contributed, group, redo)
        if share is None:
            return {f: x.result() for f, x in zip(due, exchanges)}
        return {f: self.runtime.exchange(self._sent_delta(f, x), group, len(members),
                                         share).result() for f, x in zip(due, flights)}

    def _sent_delta(self, fragment: int, x: Optional[InFlight]) -> torch.Tensor:
        """The pseudo-gradient this island sent for `fragment` (zeros: none of its own)."""
        if x is None or x.delta is None or not x.contributed:
            return torch.zeros(int(self.mask(fragment).sum()))
        return x.delta.clone()
