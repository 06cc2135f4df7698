"""Elastic islands' side of fragmented DiLoCo (a part of dragon.diloco.fragments.FragmentedDiLoCo):
each event of the fragment schedule, a sync or a landing, is a round among the islands that reach
it (dragon.diloco.membership runs and retries it).

Sync mode: the fragments that sync exchange and land in the round. Delayed mode: a fragment's
exchange starts in the round of its sync and lands `fragment_delay` inner steps later, in a round
of its own. An island that dies in between leaves that exchange failed on the others: the
landing round finds so (one small all-reduce among its members) and the members redo the exchange
among themselves from the pseudo-gradients each kept, divided by those of them that contributed
to it, as the whole model's late average is redone (dragon.diloco.elastic). A joiner first takes
theta_outer, every fragment's outer optimizer and the step from a live island, and every
fragment's weights from theta_outer (it sends zeros); a landing round with a joiner redoes the
landing among all its members, so that the joiner applies the same average as the others.
Averages are applied only once the round succeeds.
"""

import time
from typing import Optional

import torch

from dragon.diloco.exchange import ExchangeSet, broadcast_object, flatten
from dragon.diloco.landing import InFlight


class ElasticFragments:
    """FragmentedDiLoCo's rounds with --diloco_elastic (see the module's docstring)."""

    def join(self) -> tuple[int, dict]:
        self.in_flight = {}  # what this island's checkpoint had in flight is the live islands'
        return super().join()

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
                at_step = self._share_state(group, members, joiners, step, None)[0]
                root = members.index(min(i for i in members if i not in joiners))
                due = broadcast_object(due, group, root)
                if self.topology.island in joiners:
                    self._write_fragments(list(range(self.F)), 0.0)
            landed = self._land(due, group, members, bool(joiners))
            syncing, kept = self.syncing(at_step, final) if sync else [], []
            started = self._start(syncing, group, len(members), len(members) - len(joiners),
                                  keep_back=False, kept=None if blocking else kept)
            synced = {f: x.result() for f, x in zip(syncing, started)} if blocking else {}
            self.membership.publish(self.outer_step, at_step, self.shape())
            self.group = group
            mine = self.topology.island not in joiners
            return due, landed, syncing, started, synced, kept, mine, at_step

        due, landed, syncing, started, synced, kept, mine, self.joined_step = \
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
        self.in_flight.update({f: InFlight(x, at + self.delay, at, delta, mine)
                               for f, x, delta in zip(syncing, started, kept)})
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
        metrics.update(self._exchange_metrics(ExchangeSet(started), applied, final))
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
        return {f: self.exchange(self._kept(f, x), group, len(members), share).result()
                for f, x in zip(due, flights)}

    def _kept(self, fragment: int, x: Optional[InFlight]) -> torch.Tensor:
        """The pseudo-gradient this island sent for `fragment` (zeros: none of its own)."""
        if x is None or x.delta is None or not x.contributed:
            return torch.zeros(int(self.mask(fragment).sum()))
        return x.delta.clone()
