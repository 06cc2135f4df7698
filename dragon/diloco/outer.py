"""DiLoCo (Douillard et al., 2023; streaming: 2025): islands train on their own and meet every H
steps for an outer step (a round among them: dragon.diloco.membership), the weights cut into F
fragments (dragon.diloco.fragment) that meet in turn.

Fragment f syncs after inner steps floor(f H/F) + kH: each rank averages its Delta_f =
theta_outer_f - theta_f (fp32, on its part of dragon.parallel.master_weights) with rank r of every
other island, and the fragment's outer optimizer steps theta_outer_f with the average. sync: the
exchange blocks and theta_f becomes theta_outer_f; delayed: it runs under the inner steps and
lands later (dragon.diloco.landing). The last step syncs all, blocking: islands end identical."""

import logging
import time
from typing import TYPE_CHECKING, Optional

import torch

from dragon.diloco.fragment import Fragment, InFlight, OptimizerFactory, placed
from dragon.diloco.fragment_cut import INTERLEAVED, fragment_ids
from dragon.diloco.landing import AUTO, AutoLandings
from dragon.diloco.membership import LateForQuorum, Round, staleness_weight
from dragon.diloco.quorum import MissedRound
from dragon.diloco.pace import pace_for
from dragon.diloco.runtime import OuterRuntime, resumable_state
import dragon.diloco.state as saved_state
from dragon.wire.codecs import Codec
from dragon.wire.exchange import Exchange, flatten

if TYPE_CHECKING:
    from dragon.diloco.config import DiLoCoConfig
    from dragon.parallel.topology import Topology

logger = logging.getLogger("dragon")


class DiLoCo:
    """The outer loop of one rank: call maybe_outer_step(step) after every inner step. `weights`
    as for OuterRuntime (F > 1: also segments() and shapes()); `outer_optimizer` builds a torch
    optimizer over a fragment's theta_outer; `ids`: each value's fragment (default:
    dragon.diloco.fragment_cut); `tokens_per_step`: the island's (dragon.diloco.pace)."""

    def __init__(self, weights, config: "DiLoCoConfig", topology: "Topology",
                 outer_optimizer: Optional[OptimizerFactory] = None,
                 ids: Optional[torch.Tensor] = None, tokens_per_step: int = 1):
        self.runtime = OuterRuntime(weights, config, topology)
        self.weights, self.config, self.topology = weights, config, topology
        self.H, self.mode, self.F = config.inner_steps, config.mode, config.fragments
        self.numels, self.membership = self.runtime.numels, self.runtime.membership
        self.eager = self.mode == "delayed" and self.F == 1
        self.alpha = config.fragment_alpha if self.mode == "delayed" and not self.eager else 0.0
        self.delay, self.auto = config.fragment_delay, None
        if self.delay == AUTO:
            if self.runtime.background is not None:
                self.auto = AutoLandings(topology, self.runtime.background, self.H)
            self.delay = 1  # one island has no link to wait for
        self.make_optimizer = outer_optimizer or config.outer_optimizer
        self.cut_as(INTERLEAVED, ids)
        self.outer_step = self.joined_step = 0
        self.late_deltas: Optional[list[torch.Tensor]] = None  # landing late: what it trained
        self.pace = pace_for(config, topology, tokens_per_step)  # unequal islands, else None

    def cut_as(self, cut: str, ids: Optional[torch.Tensor] = None) -> None:
        """Fragments afresh from the current weights, cut as `cut` (or by `ids`): nothing stepped
        or in flight, for a state saved with another cut (fragment_cut.RUNS) to load into."""
        self.cut, whole, self.fragments = cut, flatten(self.weights.tensors()), []
        if self.F > 1 and ids is None:
            ids = fragment_ids(self.weights.segments(), self.weights.shapes(), self.numels,
                               self.F, cut)
        kept = dict(topk=self.config.compress in ("topk", "sparseloco"),
                    decay=self.config.error_decay)
        if self.F == 1:
            self.fragments = [Fragment(0, None, self.numels, whole, self.runtime.device,
                                       self.make_optimizer, **kept)]
        else:
            self.fragments = [Fragment(f, ids, None, whole[ids == f], self.runtime.device,
                                       self.make_optimizer, **kept) for f in range(self.F)]

    # ----------------------------------------------------------- the schedule

    def is_boundary(self, step: int, final: bool = False) -> bool:
        """Whether a checkpoint may be taken after inner step `step`."""
        return step % self.H == 0 or final

    def syncing(self, step: int, final: bool) -> list[int]:
        """The fragments that sync after inner step `step` (at the last step, all)."""
        if final:
            return list(range(self.F))
        offsets = [f * self.H // self.F for f in range(self.F)]
        return [f for f, o in enumerate(offsets) if step >= max(o, 1) and step % self.H == o]

    def landing(self, step: int, final: bool) -> list[int]:
        """The fragments in flight that land after inner step `step` (eager: none)."""
        if self.eager:
            return []
        flying = {f.number: f.in_flight for f in self.fragments if f.in_flight is not None}
        if self.auto is not None and not final:
            for f, x in flying.items():
                self.auto.decide(f, x, step)
        return sorted(f for f, x in flying.items()
                      if final or (x.lands_at is not None and x.lands_at <= step))

    def trains(self, step: int) -> bool:
        """Whether this island trains inner step `step` (else it rests: dragon.diloco.pace)."""
        return self.pace is None or self.pace.trains(step)

    def islands_training(self, step: int) -> int:
        """How many islands train inner step `step` (unequal islands: those whose plan has it)."""
        return self.topology.islands if self.pace is None else self.pace.islands_training(step)

    def trained(self) -> None:
        """After a trained inner step (dragon.run.loop.TrainingRun.end_step): its time."""
        if self.pace is not None:
            self.pace.ended()

    def is_due(self, step: int, final: bool) -> bool:
        return bool(self.syncing(step, final) or self.landing(step, final))

    def maybe_outer_step(self, step: int, final: bool = False) -> dict:
        """After inner step `step` (1-based): the outer step when one is due, with its metrics;
        else {}. `final` makes the last step an outer step that lands and syncs everything."""
        return self.runtime.run(step, final, self.is_due, self._outer_step)

    # ----------------------------------------------------------- an outer step

    def _outer_step(self, step: int, final: bool, joining: bool = False) -> dict:
        """The rounds of inner step `step`: a fragment that lands and syncs again at once lands
        first, in a round of its own, so that it syncs from the weights its landing left."""
        start, rounds = time.perf_counter(), []
        try:
            if set(self.landing(step, final)) & set(self.syncing(step, final)):
                rounds.append(self._round(step, final, joining, sync=False))
                joining = False
            rounds.append(self._round(step, final, joining))
        except LateForQuorum as late:
            return self._land_late(late)
        self.runtime.waited([x.exchange for r in rounds for x in r.flights
                             if x.lands_at == x.synced_at + self.H])  # eager: a window later
        metrics = {"outer_step": self.outer_step, **self.membership.metrics(),
                   **self.runtime.report.of_rounds(rounds, self.fragments, step, final,
                                                   self.topology.island)}
        metrics["outer_seconds"] = time.perf_counter() - start
        return metrics

    def _round(self, step: int, final: bool, joining: bool, sync: bool = True
               ) -> Round:
        """One round among the islands that reach it, then what it settled, applied."""
        self.outer_step += 1
        done = self.membership.run_round(
            self.outer_step, lambda *group: self._attempt(step, final, sync, *group), joining,
            final)
        self.joined_step = done.step
        if done.plan is not None:
            self.pace.settle(done.plan)
        done.flights = [self.fragments[f].in_flight for f in done.landed
                        if self.fragments[f].in_flight is not None]  # a joiner has none
        for f in done.landed:
            self.fragments[f].in_flight = None
        for fragment, x, delta in zip(self._of(done.syncing), done.started, done.deltas):
            if fragment.residual is not None:  # what top-k did not send
                fragment.residual = delta - x.sent
        if self.eager and done.syncing:
            self._apply_eager(done, final)
        else:
            self._land(done.landed, self.alpha)
            self._land(done.synced, 0.0)
        if not (self.mode == "sync" or final):
            self._fly(done)
        return done

    def _attempt(self, step: int, final: bool, sync: bool, members: list[int], group,
                 joiners: list[int], late: dict) -> Round:
        """One attempt at a round among `members`: joiners take the live islands' state, what is
        due lands, what syncs starts. It applies nothing, so that it can be retried."""
        island = self.topology.island
        weight = {i: staleness_weight(late.get(i, 0)) for i in members
                  if i not in joiners or i in late}  # those that contribute
        done = Round(step=step, contributors=len(weight), contributes=island in weight,
                     late=late)
        due = self.landing(step, final)
        if sync and self.eager:  # its one fragment lands as it syncs (none in flight: nothing)
            due = [0]
        if joiners:
            done.step, due = self.runtime.share_outer_state(group, members, joiners, step,
                                                            self.fragments, due)
            if island in joiners:  # its weights are theta_outer (a joiner sends zeros)
                self._land(dict.fromkeys(range(self.F)), 0.0)
        done.landed = self._averages(due, group, members, redo=bool(joiners) and not self.eager)
        if sync:
            done.syncing = self.syncing(done.step, final)
        if self.pace is not None and done.syncing:  # unequal islands: weights by tokens
            done.scale, done.paced, done.plan = self.pace.agree(group, members, weight)
        elif late and done.syncing:  # the mean weighted by staleness
            done.scale = len(weight) * weight.get(island, 0.0) / sum(weight.values())
        local = flatten(self.weights.tensors())
        for fragment in self._of(done.syncing):
            kept = None if self.late_deltas is None else self.late_deltas[fragment.number]
            delta = fragment.delta(local, done.scale, kept)
            then = (self.auto.poster(fragment.number, done.step)  # auto: when it is done
                    if self.auto is not None and not final else None)
            done.deltas.append(delta)
            done.started.append(self.runtime.exchange(
                delta.clone(), group, len(members), done.contributors, fragment.numels, then))
        if self.mode == "sync" or final:
            done.synced = {f: x.result() for f, x in zip(done.syncing, done.started)}
        if self.eager and done.syncing:
            done.gradient = self.eager_gradient(done, final)
            if joiners and self.mode == "delayed":  # a joiner applies what the live islands do
                done.gradient = self.runtime.share_state(group, members, joiners, done.gradient)
        self.membership.publish(self.outer_step, done.step, self.runtime.shape())
        self.runtime.group = group
        return done

    def _averages(self, due: list[int], group, members: list[int], redo: bool) -> dict:
        """The averages of the fragments `due`: their exchanges' results or, when
        membership.failed says so, the exchanges redone from the kept pseudo-gradients."""
        if not due:
            return {}
        flights = [self.fragments[f].in_flight for f in due]
        exchanges = [x.exchange for x in flights if x is not None]
        contributed = all(x is not None and x.contributed for x in flights)
        what = ("the average in flight since the last outer step" if self.eager
                else f"the exchange of fragment(s) {due} in flight")
        share = self.membership.failed(self.outer_step, what, exchanges, contributed, group,
                                       redo)
        if share is None:
            return {f: x.result() for f, x in zip(due, exchanges)}
        for x in flights:
            if x is not None:
                x.share = share
        return {f.number: self.runtime.exchange(f.sent_delta(), group, len(members), share,
                                                f.numels).result() for f in self._of(due)}

    def eager_gradient(self, done: Round, final: bool) -> torch.Tensor:
        """Kale et al.'s eager outer gradient: the late average with this island's share of it
        swapped for its fresh one (at the last step, for the whole fresh average)."""
        fragment, x = self.fragments[0], done.started[0]
        share = done.deltas[0] if x.sent is None else x.sent  # top-k: what it sent
        late = done.landed.get(0, torch.zeros_like(share))
        fresh = x.result() if final else share / done.contributors
        flight = fragment.in_flight
        previous_share = (flight.share if flight is not None else 0) or self.topology.islands
        return late - fragment.sent_delta() / previous_share + fresh

    # ----------------------------------------------------------- applying a round

    def _of(self, numbers) -> list[Fragment]:
        return [self.fragments[f] for f in numbers]

    def _land(self, averages: dict, alpha: float) -> None:
        """Step each fragment's outer optimizer with its average (None: no step), then write
        theta_f <- alpha theta_f + (1 - alpha) theta_outer_f into the master and working weights."""
        if not averages:
            return
        flat = flatten(self.weights.tensors())
        for fragment in self._of(sorted(averages)):
            if averages[fragment.number] is not None:
                fragment.step(averages[fragment.number])
            fragment.place(flat, fragment.merged(flat, alpha))
        self.runtime.write(flat.split(self.numels))

    def _apply_eager(self, done: Round, final: bool) -> None:
        """Plain DiLoCo, delayed: one step with the eager gradient; the last one also averages
        theta_outer over the islands (each stepped its own momentum)."""
        fragment = self.fragments[0]
        fragment.step(done.gradient)
        if final and len(self.membership.members) > 1:
            average = Exchange(flatten([fragment.outer]), self.runtime.group,
                               len(self.membership.members), Codec(), self.numels)
            with torch.no_grad():
                fragment.outer.copy_(average.result().view_as(fragment.outer))
            done.started[0].bytes_sent += average.bytes_sent
        self.runtime.write(fragment.outer.to("cpu", torch.float32).split(self.numels))

    def _fly(self, done: Round) -> None:
        """The exchanges just started are in flight until they land."""
        for fragment, x, delta in zip(self._of(done.syncing), done.started, done.deltas):
            if self.eager:  # its share is what it sent
                kept, lands_at = delta if x.sent is None else x.sent, done.step + self.H
            else:
                kept = delta if self.config.elastic else None
                lands_at = None if self.auto is not None else done.step + self.delay
            fragment.in_flight = InFlight(x, lands_at, done.step, kept, done.contributes,
                                          done.contributors)

    def theta_outer(self) -> torch.Tensor:
        """theta_outer as one vector over this rank's values."""
        return placed(self.fragments, self.numels, lambda f: f.outer.detach())

    def join(self, after: int = 0) -> tuple[int, dict]:
        """--diloco_join: take the live islands' next outer step after `after` with them, ending
        it on their weights. Returns (step, metrics)."""
        for fragment in self.fragments:  # what this island's checkpoint had is theirs now
            fragment.in_flight = None
            fragment.forget_own_share()
        metrics = self._join_live_islands(after)
        return self.joined_step, metrics

    def _land_late(self, late: LateForQuorum) -> dict:
        """This island missed its quorum: its kept pseudo-gradient, weighted by staleness, lands
        in the live islands' next outer step (`late.counted`: they counted it; it just joins)."""
        if late.counted:
            if self.topology.island_rank == 0:
                logger.warning(f"outer step {late.outer_step}: islands {late.members} completed "
                               "it with this island's share while its exchange failed here; it "
                               "joins the next one")
            return self.join(after=late.outer_step)[1]
        if self.topology.island_rank == 0:
            logger.warning(f"outer step {late.outer_step} went on without this island (islands "
                           f"{late.members}); its pseudo-gradient lands in the next one")
        local = flatten(self.weights.tensors())
        self.late_deltas = [f.pseudo_gradient(local) for f in self.fragments]
        try:
            return self._join_live_islands(late.outer_step, late_since=late.outer_step)
        finally:
            self.late_deltas = None

    def _join_live_islands(self, after: int, late_since: Optional[int] = None) -> dict:
        """Take the live islands' first outer step after `after` that admits this island."""
        while True:
            target = self.membership.admit(self.runtime.shape(), late_since, after)
            self.outer_step = target - 1
            try:
                return self._outer_step(0, False, joining=True)
            except MissedRound:
                logger.warning(f"outer step {target} went on without this island; it joins a "
                               "later one")
                after = target

    def close(self, ended_at: Optional[int] = None) -> None:
        """After the last outer step (dragon.diloco.runtime.OuterRuntime.close)."""
        self.runtime.close(ended_at)

    # ----------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        """Every fragment's theta_outer, outer optimizer, top-k residual and exchange in flight,
        waited for here (all islands save at the same point), and its landing (auto: now)."""
        for fragment in self.fragments:
            if self.auto is not None and fragment.in_flight is not None:
                self.auto.decide(fragment.number, fragment.in_flight,
                                 self.runtime.background.clock, waiting=True)
        return saved_state.of_outer_loop(self)

    def load_state_dict(self, state: dict) -> None:
        """This rank's state as it saved it; every island must resume the same outer step."""
        self.runtime.check_same_step(state["outer_step"], "outer steps")
        saved_state.load_outer_loop(self, state)

    def resume_elsewhere(self, saved) -> None:
        """Resume from a checkpoint with no state of this rank as it is now
        (dragon.checkpoint.checkpointer.Saved): another partition's, laid out again; island 0's
        (a new island has no share of its own in flight); or one without DiLoCo (start afresh)."""
        self.runtime.check_same_step(saved.step)
        state = resumable_state(saved, saved_state.STATE_FILE, lambda tag_dir: (
            saved_state.joined_state(tag_dir, self.weights, self.numels)))
        if state is None:
            self.restart()
            return
        saved_state.load_outer_loop(self, state)
        if saved.borrowed:
            for fragment in self.fragments:
                fragment.forget_own_share()

    def restart(self) -> None:
        """Start afresh from the current weights (a checkpoint saved without DiLoCo)."""
        self.runtime.adopt_island0_weights()
        whole = flatten(self.weights.tensors())
        for fragment in self.fragments:
            fragment.restart(fragment.of(whole))
        self.outer_step = 0
