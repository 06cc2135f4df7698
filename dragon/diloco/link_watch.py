"""Says once, in one line, when the link is slower than DiLoCo's window of H inner steps: inner
steps then wait for what does not fit under the window's compute (delayed mode)."""

import logging
import math
import statistics
import time
from collections import deque
from typing import Optional

from dragon.wire.codecs import VALUE_BYTES

logger = logging.getLogger("dragon")


class LinkWatch:
    """Inner-step times and exchange rates of one rank's outer loop."""

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
