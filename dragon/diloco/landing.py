"""When a fragment in flight lands (streaming DiLoCo, delayed mode): D inner steps after it synced
(--diloco_fragment_delay D) or, with `auto`, where the islands agree without a blocking collective.
The exchange thread (dragon.wire.exchange_thread) finishes an exchange during inner step t + 1 and
posts t + 2, its proposal, to the store. The fragment lands after step L, the largest proposal of
any rank, or at the latest at the bound, when it syncs again H steps later (the inner loop waits
there for the rest; a rank not done by then proposes later, so all land there). A rank reads the
proposals only after the step it proposed (L, at least that, lies ahead until then), so none has
passed L when it learns it. A checkpoint decides and saves each landing: a resume lands the same."""

import queue
import threading
import time
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

from dragon.diloco.fragment import InFlight

AUTO = "auto"
# a proposal is a step later than needed: a step for the reader to bring the other ranks' in
LOOKAHEAD = 1
_PREFIX = "dragon-diloco/landing"


class AutoLandings:
    """One rank's proposals in the store and the landings they agree on. A thread on its own store
    connection reads all ranks' proposals early: a store round trip is slow on a busy link."""

    def __init__(self, topology, background, inner_steps: int):
        self.topology, self.background, self.H = topology, background, inner_steps
        self.generation: Optional[int] = None  # the first step of this start: a resume's own keys
        self._read: dict[tuple, tuple] = {}  # (fragment, synced_at) -> (done, proposals, error)
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._watch, name="diloco-landings", daemon=True).start()

    def _key(self, fragment: int, synced_at: int, island: int, rank: int) -> str:
        return (f"{_PREFIX}/g{self.generation}/s{synced_at}f{fragment}/island{island}/"
                f"rank{rank}")

    def poster(self, fragment: int, synced_at: int) -> Callable[[int], None]:
        """The exchange thread's callback that posts its proposal (made when the fragment syncs)."""
        if self.generation is None:
            self.generation = synced_at
        self._read[fragment, synced_at] = (threading.Event(), [], [])
        self._events.put((fragment, synced_at))
        t, key = self.topology, self._key(fragment, synced_at, self.topology.island,
                                          self.topology.island_rank)
        return lambda ready_after: t.store.set(key, str(ready_after + LOOKAHEAD))

    def decide(self, fragment: int, x: InFlight, step: int, waiting: bool = False) -> None:
        """Set x.lands_at once this rank can (after inner step `step`); `waiting`: a checkpoint,
        which waits for the exchange first."""
        if x.lands_at is not None:
            return
        bound = x.synced_at + self.H
        if waiting:
            x.exchange.result()
        own = self.background.ready_after(x.exchange.ticket)
        own = None if own is None else own + LOOKAHEAD
        if waiting:  # every rank waits at the same step: none passes the step after it
            step = max(step, own)
        if own is None or own > step:  # not ready here yet: it lands later, at the bound at most
            if step >= bound:
                x.lands_at = bound
            return
        done, proposals, error = self._read[fragment, x.synced_at]
        start = time.perf_counter()
        finished = done.wait(self.topology.timeout_s)
        x.exchange.ticket.blocked += time.perf_counter() - start  # counted as a wait
        if not finished or error:
            raise RuntimeError(f"no landing proposals for fragment {fragment} synced at step "
                               f"{x.synced_at} within {self.topology.timeout_s:.0f} s {error}")
        del self._read[fragment, x.synced_at]
        x.lands_at = min(max(proposals), bound)

    def _watch(self) -> None:
        """Read each event's proposals once every rank posted them, in the order they synced."""
        t = self.topology
        store = t.store
        if hasattr(store, "host"):  # a connection of its own: the training thread's stays free
            store = dist.TCPStore(store.host, store.port, is_master=False,
                                  timeout=timedelta(seconds=t.timeout_s))
        while True:
            fragment, synced_at = self._events.get()
            done, proposals, error = self._read[fragment, synced_at]
            keys = [self._key(fragment, synced_at, i, r) for i in range(t.islands)
                    for r in range(t.island_size)]
            try:
                deadline = time.monotonic() + t.timeout_s
                while not store.check(keys) and time.monotonic() < deadline:
                    time.sleep(0.01)
                proposals += [int(store.get(key)) for key in keys]
            except RuntimeError as e:  # the store is gone: the training thread names the island
                error.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
            done.set()
