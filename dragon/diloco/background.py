"""The exchange thread: runs DiLoCo's outer exchanges off the training thread (delayed mode).

The training thread hands over an encoded pseudo-gradient (dragon.diloco.exchange.Exchange) and
later takes the islands' average; everything on the link, and the decoding, runs here, so an
inner step waits for the link only when a landing is due before its exchange is done. Jobs run
one at a time in the order handed over: the outer-step schedule, the same on every island, so
rank r of every island issues the same collectives in the same order and none waits on another's
later one. They use a gloo group of their own, never the training thread's cross-island group:
one gloo group must never be used from two threads at once."""

import logging
import math
import queue
import statistics
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

logger = logging.getLogger("dragon")

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


class Background:
    """One rank's exchange thread and its own gloo group among rank r of every island."""

    made = 0  # outer loops made in this process: each its own group, named in the same order

    def __init__(self, topology):
        Background.made += 1
        name = f"{_PREFIX}/background{Background.made}/rank{topology.island_rank}"
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


# bytes a value on the wire, before the ring's factor (int8, int4: plus a 4-byte scale a block)
VALUE_BYTES = {"none": 4.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5}


class LinkWatch:
    """Inner-step times and exchange rates; says once, in one line, when the link is slower than
    the window (inner steps then wait for what does not fit under the window's compute)."""

    def __init__(self, inner_steps: int, fragments: int, compress: str, block: int):
        self.H, self.F, self.compress, self.block = inner_steps, fragments, compress, block
        self._steps: deque = deque(maxlen=64)
        self._last: Optional[float] = None
        self.said = False

    def begin(self) -> None:
        """Since end(): an inner step's compute (the median leaves out evaluations and saves)."""
        if self._last is not None:
            self._steps.append(time.perf_counter() - self._last)

    def end(self) -> None:
        self._last = time.perf_counter()

    def waited(self, exchange) -> None:
        """An inner step waited for `exchange`, due a window after it started: say once if the
        link is slower than the window. A wait shorter than an inner step is skew, not the link."""
        if self.said or exchange.seconds <= 0 or len(self._steps) < 2:
            return
        step = statistics.median(self._steps)
        if exchange.blocked < max(step, 0.1):
            return
        rate = exchange.bytes_sent / exchange.seconds
        window_bytes = exchange.bytes_sent * self.F  # a fragment's exchange: 1/F of the window's
        window = step * self.H
        need = window_bytes / rate if rate > 0 else math.inf
        if need <= window:
            return
        self.said = True
        logger.warning(self.shortfall(window_bytes, rate, need, window))

    def shortfall(self, window_bytes: float, rate: float, need: float, window: float) -> str:
        """The one line: bytes per window, the link rate measured, what would fit."""
        fits = [f"--diloco_inner_steps {math.ceil(self.H * need / window)}"]
        now = VALUE_BYTES.get(self.compress)
        for codec in ("bf16", "int8", "int4"):
            scale = 4 / self.block if codec in ("int8", "int4") and self.block else 0.0
            if now and VALUE_BYTES[codec] + scale < now and need * (
                    VALUE_BYTES[codec] + scale) / now <= window:
                fits.append(f"--diloco_compress {codec}")
                break
        return (f"DiLoCo: the link is slower than the window: {window_bytes / 1e6:.2f} MB per "
                f"window at the {rate * 8 / 1e6:.2f} Mbit/s measured take {need:.1f} s, the "
                f"window's {self.H} inner steps {window:.1f} s; inner steps wait for the rest. "
                f"Would fit: {' or '.join(fits)}")
