"""One exchange of a flat fp32 tensor among islands (rank r of each): the codec's collective
(dragon.wire.codecs), issued asynchronously or on the exchange thread (dragon.wire.exchange_thread),
with its bytes sent (measured or modelled) and its times; or, restored from a checkpoint, its
average (FinishedExchange), with the same fields."""

import io
import time
from typing import Any, Optional, Union

import torch

from dragon.wire.codecs import Codec


def flatten(tensors) -> torch.Tensor:
    """One contiguous fp32 CPU vector (gloo exchanges CPU tensors)."""
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def cpu_bytes_written() -> Optional[int]:
    """Bytes this process has passed to write()/send() so far (/proc/self/io wchar), else None.
    gloo's TCP transport writes through these calls, so around a blocking collective with nothing
    else running the difference is what this rank put on the wire, headers included."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def ring_bytes(op: str, payload_bytes: int, members: int) -> int:
    """Bytes one member sends in gloo's ring algorithms (measured equal on CPU: see tests)."""
    if members <= 1:
        return 0
    if op == "allreduce":
        return 2 * (members - 1) * payload_bytes // members
    if op == "allgather":
        return (members - 1) * payload_bytes
    if op == "scatter":  # an all-to-all, then an all-gather, of 1/members of the payload each
        return 2 * (members - 1) * payload_bytes // members
    raise ValueError(op)


class Exchange:
    """One outer all-reduce of a flat fp32 pseudo-gradient, started on construction; result()
    waits for the islands' average, identical on every island. With `background`, it runs on
    that thread's group in submission order, then calls `then(ready_after)` there."""

    def __init__(self, flat: torch.Tensor, group, islands: int, codec: Codec,
                 numels: list[int], measure_bytes: bool = False,
                 contributors: Optional[int] = None, background=None, then=None):
        self.codec, self.numels, self.n, self.islands = codec, numels, flat.numel(), islands
        self.contributors = contributors or islands  # what the sum is divided by
        self.norm_sq = float(torch.dot(flat, flat))
        before = cpu_bytes_written() if measure_bytes else None
        self.started = self.began = time.perf_counter()
        self.waited: Optional[float] = None  # when the training thread first waited for it
        self.finished: Optional[float] = None  # when that wait returned
        self.done_at: list[float] = []  # when the collective completed
        self.ticket = None
        self.work = None
        self._result: Optional[torch.Tensor] = None
        encoded = codec.encode(flat, islands, numels)
        self.payload, self.payload_bytes = encoded.payload, encoded.payload_bytes
        self.error_sq, self.sent = encoded.error_sq, encoded.sent
        self.bytes_sent = ring_bytes(codec.op, self.payload_bytes, islands)  # unless measured
        self.gathered = [self.payload]
        if background is not None:
            self.ticket = background.submit(lambda: self._communicate(background.group), then)
        else:
            # int4's all-to-all blocks on this thread; its all-gather then runs asynchronously
            self.payload = codec.reduce_chunks(self.payload, group, islands)
            self.gathered = [self.payload]
            if group is None or islands == 1:
                self.done_at.append(self.started)
            else:
                self.work = self._issue(group)
                self.work.get_future().then(lambda _: self.done_at.append(time.perf_counter()))
        if measure_bytes:  # blocking: nothing else writes meanwhile, so the count is this one's
            self.result()
            after = cpu_bytes_written()
            if before is not None and after is not None:
                self.bytes_sent = after - before

    def _issue(self, group):
        """The collective: an all-reduce in place, or an all-gather of every island's code."""
        if self.codec.op == "allreduce":
            return group.allreduce([self.payload])
        self.gathered = [torch.empty_like(self.payload) for _ in range(self.islands)]
        return group.allgather([self.gathered], [self.payload])

    def _communicate(self, group) -> None:
        """On the exchange thread: the collectives (int4's all-to-all first), then the average."""
        self.began = time.perf_counter()
        self.payload = self.codec.reduce_chunks(self.payload, group, self.islands)
        self.gathered = [self.payload]
        if group is not None and self.islands > 1:
            self._issue(group).wait()
        self.done_at.append(time.perf_counter())
        self._result = self._average()

    @property
    def done(self) -> bool:
        if self.ticket is not None:
            return self.ticket.done
        return self._result is not None or self.work is None or self.work.is_completed()

    def result(self) -> torch.Tensor:
        """The islands' average pseudo-gradient (waits for it the first time)."""
        if self.waited is None:
            self.waited = time.perf_counter()
        if self.ticket is not None:
            self.ticket.wait()
            self.finished = self.done_at[0]
            return self._result
        if self._result is None:
            if self.work is not None:
                self.work.wait()
            self.finished = time.perf_counter()
            self._result = self._average()
        return self._result

    def _average(self) -> torch.Tensor:
        total = self.codec.total(self.gathered, self.n, self.numels)
        self.payload = self.gathered = None
        return total / self.contributors

    @property
    def blocked(self) -> float:
        """Seconds the training thread waited for the exchange thread to finish it."""
        return self.ticket.blocked if self.ticket is not None else 0.0

    @property
    def _completed(self) -> float:
        """When the collective completed: from its future, else when the wait returned."""
        return self.done_at[0] if self.done_at else self.finished

    @property
    def seconds(self) -> float:
        """Start to completion of the collective (exchange thread: from when it began there)."""
        return max(0.0, self._completed - self.began)

    @property
    def hidden_seconds(self) -> float:
        """The part of the collective that ran before anyone waited for it."""
        return max(0.0, min(self._completed, self.waited) - self.began)


class FinishedExchange:
    """From a checkpoint: the average, or None if an island died in it (the next step redoes it)."""

    bytes_sent = payload_bytes = 0
    error_sq = norm_sq = seconds = hidden_seconds = blocked = 0.0
    sent = ticket = None
    done = True

    def __init__(self, average: Optional[torch.Tensor]):
        self.average = average

    def result(self) -> torch.Tensor:
        if self.average is None:
            raise RuntimeError("the exchange in flight at this checkpoint failed")
        return self.average


AnyExchange = Union[Exchange, FinishedExchange]


def broadcast_object(value: Any, group, root: int) -> Any:
    """`value` of member `root`, on every member of a gloo group (torch.save's format)."""
    size = torch.zeros(1, dtype=torch.int64)
    if value is not None:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        size[0] = payload.numel()
    group.broadcast(size, root).wait()
    if value is None:
        payload = torch.empty(int(size[0]), dtype=torch.uint8)
    group.broadcast(payload, root).wait()
    return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
