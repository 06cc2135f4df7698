"""One exchange of a flat fp32 tensor among islands (rank r of each): all-reduce in fp32 or bf16, an
all-gather of int8 codes with absmax scales or of top-k codes (dragon.diloco.sparse), or a 4-bit
all-to-all and all-gather whose bytes do not grow with the islands (dragon.diloco.quantized);
asynchronous (int4: its all-gather), or wholly on the exchange thread of dragon.diloco.background
(encoded on the training thread, everything on the link and the decoding there), with the bytes
it sends (measured or modelled) and its times recorded."""

import io
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from dragon.diloco.quantized import chunk_codes, gathered_sum, reduce_chunk, scatter_reduce
from dragon.diloco.sparse import topk_encode, topk_sum

def flatten(tensors) -> torch.Tensor:
    """One contiguous fp32 CPU vector (gloo exchanges CPU tensors)."""
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def cpu_bytes_written() -> Optional[int]:
    """Bytes this process has passed to write()/send() so far (Linux /proc/self/io wchar), else
    None.

    gloo's TCP transport writes through these calls, so around a blocking collective with nothing
    else running the difference is the bytes this rank put on the wire (payload plus headers).
    """
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


def _int8_encode(
    x: torch.Tensor, block: int, numels: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes, fp32 scales): round-to-nearest of x / scale, scale = absmax / 127 per block."""
    if block > 0:
        blocks = -(-x.numel() // block)
        xb = torch.nn.functional.pad(x, (0, blocks * block - x.numel())).view(blocks, block)
        scale = xb.abs().amax(dim=1) / 127
    else:  # one scale per tensor
        xb = None
        scale = (
            torch.stack([s.abs().max() if s.numel() else s.new_zeros(()) for s in x.split(numels)])
            / 127
        )
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    if xb is not None:
        q = (xb * inverse[:, None]).round_().clamp_(-127, 127).to(torch.int8).view(-1)
    else:
        q = (
            (x * torch.repeat_interleave(inverse, torch.tensor(numels)))
            .round_()
            .clamp_(-127, 127)
            .to(torch.int8)
        )
    return q, scale.float()


def _int8_decode(
    q: torch.Tensor, scale: torch.Tensor, block: int, numels: list[int], n: int
) -> torch.Tensor:
    if block > 0:
        return (q.view(-1, block).float() * scale[:, None]).view(-1)[:n]
    return q.float() * torch.repeat_interleave(scale, torch.tensor(numels))


class Exchange:
    """One outer all-reduce of a flat fp32 pseudo-gradient among the islands (rank r of each).

    Started on construction (asynchronously); result() waits and returns the islands' average,
    identical on every island. Records its payload, the bytes sent, the compression error and
    the times it started, completed (from the work's future) and was waited for. With
    `background` (a dragon.diloco.background.Background) its collectives run on that thread's
    group, in the order exchanges were made; `then(ready_after)` runs there once the average is
    ready.
    """

    def __init__(
        self,
        flat: torch.Tensor,
        group,
        islands: int,
        compress: str,
        block: int,
        numels: list[int],
        measure_bytes: bool,
        contributors: Optional[int] = None,
        topk: float = 0.0,
        background=None,
        then=None,
    ):
        self.compress, self.block, self.numels, self.n, self.islands = (
            compress,
            block,
            numels,
            flat.numel(),
            islands,
        )
        self.contributors = contributors  # what the sum is divided by (default: islands)
        self.topk = topk  # compress "topk": the fraction of entries sent (dragon.diloco.sparse)
        self.sent: Optional[torch.Tensor] = None  # topk: what this island's code decodes to
        self.error_sq, self.norm_sq = 0.0, float(torch.dot(flat, flat))
        before = cpu_bytes_written() if measure_bytes else None
        self.started = self.began = time.perf_counter()
        self.ticket = None  # background: the job on the exchange thread
        if background is not None:
            group = background.group
        payload, op, self.payload_bytes = self._encode(flat, group, background is not None)
        self.payload, self.op = payload, op
        self.bytes_sent = ring_bytes(op, self.payload_bytes, islands)  # a model, unless measured
        self.done_at: list[float] = []
        self._result: Optional[torch.Tensor] = None
        if background is not None:
            self.work = None
            self.ticket = background.submit(lambda: self._communicate(group), then)
        elif group is None or islands == 1:
            self.work, self.gathered = None, [payload]
            self.done_at.append(self.started)
        else:
            if op == "allreduce":
                self.work = group.allreduce([payload])
            else:  # int8: every island's codes; int4: every island's summed chunk
                self.gathered = [torch.empty_like(payload) for _ in range(islands)]
                self.work = group.allgather([self.gathered], [payload])
            self.work.get_future().then(lambda _: self.done_at.append(time.perf_counter()))
        if measure_bytes:  # blocking: nothing else writes meanwhile, so the count is this one's
            self.result()
            after = cpu_bytes_written()
            if before is not None and after is not None:
                self.bytes_sent = after - before

    def _encode(self, flat: torch.Tensor, group, later: bool = False
                ) -> tuple[torch.Tensor, str, int]:
        """(what the collective sends, which collective, the bytes of this island's whole
        payload); records this island's encoding error. int4 runs its all-to-all here (blocking)
        and sends the code of its summed chunk (dragon.diloco.quantized); `later`: the exchange
        thread runs it, and int4 sends its chunks' codes to it."""
        if self.compress == "none":
            return flat, "allreduce", flat.numel() * 4
        if self.compress == "bf16":
            payload = flat.bfloat16()
            self.error_sq = float((payload.float() - flat).pow(2).sum())
            return payload, "allreduce", payload.numel() * 2
        if self.compress == "int4" and later:
            payload, self.error_sq = chunk_codes(flat, self.islands, self.block)
            return payload, "scatter", payload.numel()
        if self.compress == "int4":
            payload, self.error_sq = scatter_reduce(flat, group, self.islands, self.block)
            return payload, "scatter", payload.numel() * self.islands
        if self.compress == "topk":
            payload, self.sent = topk_encode(flat, self.topk)
            self.error_sq = float((self.sent - flat).pow(2).sum())
            return payload, "allgather", payload.numel()
        q, scale = _int8_encode(flat, self.block, self.numels)
        self.error_sq = float(
            (_int8_decode(q, scale, self.block, self.numels, self.n) - flat).pow(2).sum()
        )
        self.scale_bytes = scale.numel() * 4
        payload = torch.cat([scale.view(torch.int8), q])
        return payload, "allgather", payload.numel()

    def _communicate(self, group) -> None:
        """On the exchange thread: every collective (int4: its all-to-all first), then the
        average."""
        self.began = time.perf_counter()
        if self.compress == "int4":
            self.payload = reduce_chunk(self.payload, group, self.islands, self.block)
        if group is None or self.islands == 1:
            self.gathered = [self.payload]
        elif self.op == "allreduce":
            group.allreduce([self.payload]).wait()
        else:
            self.gathered = [torch.empty_like(self.payload) for _ in range(self.islands)]
            group.allgather([self.gathered], [self.payload]).wait()
        self.done_at.append(time.perf_counter())
        self._result = self._average()

    def result(self) -> torch.Tensor:
        """The islands' average pseudo-gradient (waits for it the first time)."""
        if self.ticket is not None:
            if not hasattr(self, "waited"):
                self.waited = time.perf_counter()
            self.ticket.wait()
            self.finished = self.done_at[0]
            return self._result
        if self._result is None:
            self.waited = time.perf_counter()
            if self.work is not None:
                self.work.wait()
            self.finished = time.perf_counter()
            self._result = self._average()
        return self._result

    @property
    def blocked(self) -> float:
        """Seconds the training thread waited for the exchange thread to finish it."""
        return self.ticket.blocked if self.ticket is not None else 0.0

    def _average(self) -> torch.Tensor:
        if self.op == "allreduce":
            total = self.payload.float()
        elif self.op == "scatter":
            total = gathered_sum(self.gathered, self.n, self.block)
        elif self.compress == "topk":
            total = topk_sum(self.gathered, self.n)
        else:
            total = torch.zeros(self.n, dtype=torch.float32)
            cut = self.scale_bytes
            for packed in self.gathered:  # island order: the same sum on every island
                scale = packed[:cut].view(torch.float32)
                total += _int8_decode(packed[cut:], scale, self.block, self.numels, self.n)
        self.payload = self.gathered = None
        return total / (self.contributors or self.islands)

    @property
    def _done(self) -> float:
        """When the collective completed: from its future, else when the wait returned."""
        return self.done_at[0] if self.done_at else self.finished

    @property
    def seconds(self) -> float:
        """From start to completion of the collective (on the exchange thread: from when that
        thread began it)."""
        return max(0.0, self._done - self.began)

    @property
    def hidden_seconds(self) -> float:
        """The part of the collective that ran before anyone waited for it."""
        return max(0.0, min(self._done, self.waited) - self.began)


@dataclass
class Round:
    """One outer step's exchange, and what an elastic round settled with it."""

    exchange: Exchange
    late: Optional[Exchange] = None  # delayed: the average applied one step late
    gradient: Optional[torch.Tensor] = None  # delayed or shared by a live island
    contributors: Optional[int] = None  # what the exchange divides by (default: every island)
    step: int = 0  # the step shared with a joiner


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
