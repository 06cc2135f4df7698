"""The exchange thread: runs exchanges off the training thread (DiLoCo's delayed mode).

The training thread hands over an encoded pseudo-gradient (dragon.wire.exchange.Exchange) and
later takes the islands' average; everything on the link, and the decoding, runs here, so an
inner step waits for the link only when a landing is due before its exchange is done. Jobs run
one at a time in the order handed over: the outer-step schedule, the same on every island, so
rank r of every island issues the same collectives in the same order and none waits on another's
later one. They use a gloo group of their own, never the training thread's cross-island group:
one gloo group must never be used from two threads at once."""

import queue
import threading
import time
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

_PREFIX = "dragon-diloco"


class Ticket:
    """A job handed to the thread: done once it ran (its error, if it raised, re-raised on wait)."""

    def __init__(self):
        self._done = threading.Event()
        self.error: Optional[BaseException] = None
        self.ready_after: Optional[int] = None  # the first inner step that ends after it ran
        self.blocked = 0.0  # seconds the training thread waited for it

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        if not self._done.is_set():
            start = time.perf_counter()
            self._done.wait()
            self.blocked += time.perf_counter() - start
        if self.error is not None:
            raise self.error


class ExchangeThread:
    """One rank's exchange thread and its own gloo group among rank r of every island."""

    made = 0  # outer loops made in this process: each its own group, named in the same order

    def __init__(self, topology):
        ExchangeThread.made += 1
        name = f"{_PREFIX}/background{ExchangeThread.made}/rank{topology.island_rank}"
        store = dist.PrefixStore(name, topology.store)
        self.group = dist.ProcessGroupGloo(store, topology.island, topology.islands,
                                           timedelta(seconds=topology.timeout_s))
        self.clock = 0  # the last inner step the training thread finished
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="diloco-exchange", daemon=True)
        self._thread.start()

    def tick(self, step: int) -> None:
        """The training thread has finished inner step `step` (the clock of Ticket.ready_after)."""
        with self._lock:
            self.clock = step

    def ready_after(self, ticket: Ticket) -> Optional[int]:
        """The ticket's first possible landing step (dragon.diloco.landing), read under the lock."""
        with self._lock:
            return ticket.ready_after

    def submit(self, job: Callable[[], None], then: Optional[Callable[[int], None]] = None
               ) -> Ticket:
        """Run `job` after every job handed over before it; then `then(ready_after)`."""
        ticket = Ticket()
        self._jobs.put((job, then, ticket))
        return ticket

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, then, ticket = item
            try:
                job()
            except BaseException as e:  # re-raised on the training thread, which names the island
                ticket.error = e
            with self._lock:
                ticket.ready_after = self.clock + 1
            try:
                if then is not None and ticket.error is None:
                    then(ticket.ready_after)
            except BaseException as e:
                ticket.error = e
            ticket._done.set()

    def close(self) -> None:
        """Stop the thread once the jobs handed over have run."""
        self._jobs.put(None)
        self._thread.join(timeout=60)
