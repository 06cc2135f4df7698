"""When a fragment in flight lands (streaming DiLoCo in delayed mode, dragon.diloco.outer): a
fixed number of inner steps after it synced (--diloco_fragment_delay D), or, with `auto`, at the
first inner step but one after its exchange completed on every island.

Auto, agreed without a blocking collective. The exchange thread (dragon.diloco.background) finishes
a fragment's exchange while the training thread runs inner step t + 1 (t: the last step it
finished), and posts t + 2, its proposal, to the store: the fragment's average is ready on this rank
after step t + 1, and a thread of its own has step t + 2 to read the other ranks'. The fragment
lands after inner step L = the largest proposal of every rank of every island, and at the latest
when the same fragment syncs again, H steps after it synced (the bound); at the bound the inner loop
waits for what is left of the exchange. A rank reads the proposals only once it has finished the
step of its own (until then L, which is at least its own proposal, still lies ahead) and waits for
any missing then, so no rank has passed L when it learns it (a thread of its own reads the proposals
as they come). A rank whose exchange is not done at the bound will propose a later step, so every
rank lands at the bound then. A checkpoint decides the landing of each fragment in flight as it
waits for its average, and saves it, so a resume lands it at the same step.
"""

import queue
import threading
import time
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

from dragon.diloco.fragment import InFlight

AUTO = "auto"
# a proposal is one step past the first step that ends after the exchange: the proposals' reader
# gets that step to bring the other ranks' in (over a busy link a store read takes a while)
LOOKAHEAD = 1
_PREFIX = "dragon-diloco/landing"


class AutoLandings:
    """The proposals of one rank in the store, and the landings they agree on. A thread of its
    own, on a store connection of its own, reads every rank's proposals as they come, so that the
    training thread finds them at hand (on a busy link a store round trip is slow)."""

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
        """What the exchange thread calls with its proposal for this fragment's exchange (on
        the training thread, when the fragment syncs)."""
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
