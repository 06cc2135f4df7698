"""DiLoCo (Douillard et al., 2023): islands train on their own and meet every H steps for an outer step.

Inside an island every step is an ordinary DeepSpeed step. Every H steps each rank takes its
pseudo-gradient Delta = theta_outer - theta_inner, in fp32, on its own part of DeepSpeed's fp32
MASTER weights (its partition under ZeRO-1/2/3 and the bf16 optimizer, its stage's weights in
a pipeline, the whole model under ZeRO-0), averages Delta with rank r of every other island
(dragon.topology), steps an outer optimizer (Nesterov SGD by default) on theta_outer with the
average as gradient (delayed mode: see below), and writes theta_outer back into the master
weights and the module's working weights. theta_outer and the outer optimizer's state are fp32,
on the master weights' device or on CPU (--diloco_outer_on_cpu).

Modes. sync: the all-reduce blocks. delayed: the all-reduce of outer step k runs while the inner
steps of k+1 compute and is applied at step k+1, one outer step late, with the "eager updates" of
Kale et al. (2025): each island keeps its own theta_outer and outer optimizer, and at outer step k
feeds it the average that just arrived (of step k-1) with this island's share of it, Delta_{k-1}/n,
replaced by its fresh Delta_k/n (n islands). Each island's own progress thus passes through the
outer optimizer, momentum included, as soon as it is made; only the other islands' part is late.
(An earlier version stepped one shared theta_outer on the late averages and added the island's
share raw: with the default Nesterov outer step, +44 % validation loss at H=50 against +14 % now;
with plain averaging the two are the same algorithm.) At the first outer step no average has
arrived yet, so the island steps on its fresh share alone; the last one replaces
the fresh share with the blocking average of the last window and then averages theta_outer over
the islands (their momenta differ), so training ends with every island on the same weights.

Compression (the outer step stays fp32): bf16 all-reduces Delta in bf16; int8 quantizes Delta
with one absmax scale per block of --diloco_int8_block values (0: per tensor) and all-gathers
the int8 codes and scales, each rank summing the islands' dequantized Deltas in fp32 in island
order. The relative error ||Q(Delta) - Delta|| / ||Delta|| of this island's Deltas is logged.
Bytes on the wire per rank, for n islands and a payload of P bytes: fp32 and bf16 all-reduce
2(n-1)/n * P, int8 all-gather (n-1) * P, so int8 beats a bf16 all-reduce only below 4 islands.

Metrics of an outer step (in each island's metrics.jsonl): outer_step; outer_grad_norm (of the
islands' average applied at this step, over the whole model; in delayed mode the late one, and
absent at the first step); outer_bytes_sent (the most any rank of the island sent: measured from
/proc/self/io around the blocking exchange in sync mode, the ring model above in delayed mode,
whose last step adds the average of theta_outer) and outer_payload_bytes (this rank's);
outer_comm_seconds (start to completion of the exchanges of averages applied; not the last
step's average of theta_outer) and, delayed, outer_comm_hidden_seconds (the part of it that ran
under inner steps); outer_compress_error; outer_seconds (the whole outer step);
with --diloco_checksum, float64 sums and sums of squares of the working weights and of
theta_outer over the island's ranks (equal bits on every island after a sync outer step).

Inner optimizer state, LR schedule and data stream stay per island, as in DiLoCo.
"""

import math
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from dragon.exchange import Exchange
from dragon.master_weights import MasterWeights
from dragon.topology import Topology, island_size

MODES = ("sync", "delayed")
COMPRESSIONS = ("none", "bf16", "int8")
DELAYED_MOMENTUM = 0.3  # delayed mode's best outer momentum at lr 1 (README benchmark: 0.5 was less steady)
STATE_FILE = "diloco_state"  # <tag dir>/diloco_state_<rank>.pt, written with the RNG file


def _help(text: str, **kwargs):
    return field(metadata={"help": text}, **kwargs)


@dataclass
class DiLoCoArguments:
    diloco_inner_steps: Optional[int] = _help(
        "H: inner steps per outer step. Setting it turns DiLoCo on (also with one island).", default=None)
    diloco_islands: int = _help("Islands; each trains on its own between outer steps (1 and no H: off).",
                                default=1)
    diloco_outer_lr: float = _help("Outer learning rate.", default=0.7)
    diloco_outer_momentum: float = _help("Outer momentum (0: plain SGD).", default=0.9)
    diloco_nesterov: bool = _help("Nesterov outer momentum.", default=True)
    diloco_mode: str = _help("sync, or delayed: the outer all-reduce overlaps the next H inner steps and is "
                             "applied one outer step late.", default="sync")
    diloco_compress: str = _help("Pseudo-gradient on the wire: none (fp32), bf16 or int8.", default="none")
    diloco_int8_block: int = _help("Values per int8 scale (0: one scale per tensor).", default=1024)
    diloco_outer_on_cpu: bool = _help("Keep theta_outer and the outer optimizer state on CPU.", default=False)
    diloco_checksum: bool = _help("Log a fingerprint of the working weights after every outer step.",
                                  default=False)
    diloco_island_index: Optional[int] = _help(
        "This launch's island, when each island is a launch of its own (then also --diloco_store); "
        "default: one launch holds all islands, split into contiguous blocks of ranks.", default=None)
    diloco_store: Optional[str] = _help("HOST:PORT of the store where islands meet (with "
                                        "--diloco_island_index; island 0's rank 0 hosts it).", default=None)

    def __post_init__(self):
        n, h = self.diloco_islands, self.diloco_inner_steps
        if n < 1:
            raise ValueError(f"--diloco_islands {n}: must be >= 1")
        if h is not None and h < 1:
            raise ValueError(f"--diloco_inner_steps {h}: must be >= 1")
        if n > 1 and h is None:
            raise ValueError(f"--diloco_islands {n} needs --diloco_inner_steps H (inner steps per outer step)")
        if self.diloco_mode not in MODES:
            raise ValueError(f"--diloco_mode {self.diloco_mode!r}: valid are {', '.join(MODES)}")
        if self.diloco_compress not in COMPRESSIONS:
            raise ValueError(f"--diloco_compress {self.diloco_compress!r}: valid are {', '.join(COMPRESSIONS)}")
        if self.diloco_int8_block < 0:
            raise ValueError(f"--diloco_int8_block {self.diloco_int8_block}: must be >= 0 (0: per tensor)")
        if not self.diloco_outer_lr > 0:
            raise ValueError(f"--diloco_outer_lr {self.diloco_outer_lr}: must be > 0")
        if not 0 <= self.diloco_outer_momentum < 1:
            raise ValueError(f"--diloco_outer_momentum {self.diloco_outer_momentum}: must be in [0, 1)")
        index = self.diloco_island_index
        if index is not None and not 0 <= index < n:
            raise ValueError(f"--diloco_island_index {index}: must be in [0, --diloco_islands {n})")
        if (index is None) != (self.diloco_store is None):
            raise ValueError("--diloco_island_index and --diloco_store go together (one launch per island)")
        if self.diloco_mode == "delayed" and self.diloco_outer_momentum > DELAYED_MOMENTUM:
            # measured (README benchmark, H=50, 3600 steps): lr 0.7 / Nesterov 0.9 +14 % validation loss,
            # lr 1 / Nesterov 0.3 +1.1-1.6 % (three seeds), 0.5 +1.0-2.2 %, plain averaging +1.9-2.1 %
            warnings.warn(f"--diloco_mode delayed with --diloco_outer_momentum {self.diloco_outer_momentum}: "
                          "momentum this high on one-step-late averages did worse in our benchmark; "
                          f"--diloco_outer_lr 1 --diloco_outer_momentum {DELAYED_MOMENTUM} did best")

    @property
    def enabled(self) -> bool:
        return self.diloco_inner_steps is not None

    def island_world(self, launch_world: int) -> int:
        """Ranks per island for a launch of `launch_world` ranks (ValueError when it does not split)."""
        if not self.enabled:
            return launch_world
        return island_size(self.diloco_islands, launch_world, self.diloco_island_index is not None)

    def check_training(self, args) -> None:
        """Checks against TrainingArguments: checkpoints fall on outer steps only."""
        h = self.diloco_inner_steps
        if self.enabled and args.save_steps % h:
            raise ValueError(f"--save_steps {args.save_steps}: must be a multiple of --diloco_inner_steps {h} "
                             "(checkpoints are taken at outer steps only)")

    def local_islands(self) -> list[int]:
        """The islands this launch runs."""
        if not self.enabled:
            return [0]
        if self.diloco_island_index is not None:
            return [self.diloco_island_index]
        return list(range(self.diloco_islands))

    def output_dir(self, root: str, island: int) -> str:
        """Island i's metrics.jsonl and checkpoints/: <root>/island<i> with several islands, else root."""
        return os.path.join(root, f"island{island}") if self.enabled and self.diloco_islands > 1 else root

    def resume_path(self, resume: str, save_dir: str) -> str:
        """--resume_from_checkpoint for one island: 'latest', or the same tag in the island's checkpoints."""
        if not self.enabled or self.diloco_islands == 1 or resume == "latest":
            return resume
        return os.path.join(save_dir, os.path.basename(os.path.normpath(resume)))

    def outer_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        """torch SGD with the outer lr and momentum (Nesterov unless momentum is 0)."""
        momentum = self.diloco_outer_momentum
        return torch.optim.SGD(params, lr=self.diloco_outer_lr, momentum=momentum,
                               nesterov=self.diloco_nesterov and momentum > 0)


class DiLoCo:
    """The outer loop of one rank: call maybe_outer_step(step) after every inner step.

    `weights` is a MasterWeights (or anything with tensors(), publish(), replicas, excluded and
    fingerprint()); `outer_optimizer(params)` builds any torch optimizer over theta_outer.
    """

    def __init__(self, weights, args: DiLoCoArguments, topology: Topology,
                 outer_optimizer: Optional[Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = None):
        self.weights, self.args, self.topology = weights, args, topology
        self.H, self.mode = args.diloco_inner_steps, args.diloco_mode
        self.islands, self.group = topology.islands, topology.cross_group
        masters = weights.tensors()
        self.numels = [t.numel() for t in masters]
        self.device = torch.device("cpu") if args.diloco_outer_on_cpu else masters[0].device
        self._adopt_island0_weights()
        self.outer_params = [m.detach().to(self.device, torch.float32, copy=True) for m in masters]
        self._make_optimizer = outer_optimizer or args.outer_optimizer
        self.optimizer = self._make_optimizer(self.outer_params)
        # delayed: this island's pseudo-gradient in flight, and the exchange carrying it
        self.previous = torch.zeros(sum(self.numels)) if self.mode == "delayed" else None
        self.pending: Optional[Exchange] = None
        self.outer_step = 0

    @classmethod
    def from_engine(cls, engine, args: DiLoCoArguments, topology: Topology, outer_optimizer=None):
        """The outer loop for a DeepSpeed engine; None when DiLoCo is off."""
        return cls(MasterWeights(engine), args, topology, outer_optimizer) if args.enabled else None

    def is_boundary(self, step: int, final: bool = False) -> bool:
        return step % self.H == 0 or final

    def maybe_outer_step(self, step: int, final: bool = False) -> dict:
        """After inner step `step` (1-based): the outer step when one is due, with its metrics; else {}.
        `final` makes the last step an outer step and, in delayed mode, applies what is in flight."""
        if not self.is_boundary(step, final):
            return {}
        start = time.perf_counter()
        self.outer_step += 1
        masters = self.weights.tensors()
        delta = _flatten([o - m.to(o.device, torch.float32) for o, m in zip(self.outer_params, masters)])
        own = delta.clone() if self.mode == "delayed" else None  # an fp32 all-reduce works in place
        exchange = Exchange(delta, self.group, self.islands, self.args.diloco_compress,
                            self.args.diloco_int8_block, self.numels, measure_bytes=self.mode == "sync")
        del delta
        metrics = {"outer_step": self.outer_step}
        applied = []
        if self.mode == "sync":
            applied.append(exchange)
            self._apply(exchange.result())
        else:
            applied += [e for e in (self.pending, exchange if final else None) if e is not None]
            self._apply(self._eager_gradient(own, exchange, final))
            # after the last step nothing is in flight: a run extended past it starts its pipeline afresh
            self.previous, self.pending = (torch.zeros_like(own), None) if final else (own, exchange)
            if final:
                exchange.bytes_sent += self._average_islands()
        self._write(self.outer_params)

        # metrics: one small all-reduce within the island
        sums = [exchange.error_sq, exchange.norm_sq]
        norm_sq = self._norm_sq(applied[-1].result()) if applied else 0.0
        sums.append(norm_sq)
        if self.args.diloco_checksum:
            sums += self.weights.fingerprint() + self._outer_fingerprint()
        sums = _island_reduce(sums, dist.ReduceOp.SUM)
        bytes_max = _island_reduce([float(exchange.bytes_sent)], dist.ReduceOp.MAX)[0]
        metrics.update(outer_bytes_sent=int(bytes_max), outer_payload_bytes=exchange.payload_bytes)
        if self.args.diloco_compress != "none":
            metrics["outer_compress_error"] = math.sqrt(sums[0] / sums[1]) if sums[1] > 0 else 0.0
        if applied:
            metrics["outer_grad_norm"] = math.sqrt(sums[2])
            metrics["outer_comm_seconds"] = sum(e.seconds for e in applied)
            if self.mode == "delayed":
                metrics["outer_comm_hidden_seconds"] = sum(e.hidden_seconds for e in applied)
        if self.args.diloco_checksum:
            metrics.update(weights_sum=sums[3], weights_sumsq=sums[4], outer_sum=sums[5], outer_sumsq=sums[6])
        metrics["outer_seconds"] = time.perf_counter() - start
        return metrics

    # -------------------------------------------------------------- pieces

    def _adopt_island0_weights(self) -> None:
        """Every island starts from island 0's weights (rank r of each island holds the same shard)."""
        if self.islands > 1:
            flat = _flatten(self.weights.tensors())
            self.group.broadcast(flat, 0).wait()
            self._write(flat.split(self.numels))

    def _eager_gradient(self, own: torch.Tensor, exchange: Exchange, final: bool) -> torch.Tensor:
        """Kale et al.'s eager outer gradient: the late average with this island's share of it swapped
        for its fresh one (at the last step, for the whole fresh average)."""
        late = self.pending.result() if self.pending is not None else torch.zeros_like(own)
        fresh = exchange.result() if final else own / self.islands
        return late - self.previous / self.islands + fresh

    def _average_islands(self) -> int:
        """theta_outer averaged over the islands (each stepped its own momentum); returns bytes sent."""
        if self.islands == 1:
            return 0
        average = Exchange(_flatten(self.outer_params), self.group, self.islands, "none", 0, self.numels,
                           measure_bytes=False)
        with torch.no_grad():
            for p, a in zip(self.outer_params, average.result().split(self.numels)):
                p.copy_(a.view_as(p))
        return average.bytes_sent

    def _apply(self, average: torch.Tensor) -> None:
        """One outer optimizer step on theta_outer with `average` as its gradient."""
        for p, g in zip(self.outer_params, average.split(self.numels)):
            p.grad = g.view_as(p).to(self.device)
        self.optimizer.step()
        for p in self.outer_params:
            p.grad = None

    @torch.no_grad()
    def _write(self, values) -> None:
        """theta into the fp32 master weights, then into the module's working weights."""
        for m, v in zip(self.weights.tensors(), values):
            m.copy_(v.view_as(m))
        self.weights.publish()

    def _norm_sq(self, flat: torch.Tensor) -> float:
        """This rank's share of the squared norm of a flat pseudo-gradient (copies counted once)."""
        total = float(torch.dot(flat, flat))
        offsets = [0]
        for n in self.numels:
            offsets.append(offsets[-1] + n)
        for k, start, numel in getattr(self.weights, "excluded", []):
            piece = flat[offsets[k] + start: offsets[k] + start + numel]
            total -= float(torch.dot(piece, piece))
        return total / getattr(self.weights, "replicas", 1)

    def _outer_fingerprint(self) -> list[float]:
        total = sum(float(p.double().sum()) for p in self.outer_params)
        squares = sum(float(p.double().pow(2).sum()) for p in self.outer_params)
        return [total, squares]

    # -------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        """theta_outer, the outer optimizer, the outer step and (delayed) this island's last
        pseudo-gradient and the average in flight (waited for here: the save point is the same on
        every island)."""
        pending = self.pending.result().clone() if self.pending is not None else None
        return {"outer_step": self.outer_step, "mode": self.mode, "numels": self.numels,
                "outer_params": [p.detach().cpu().clone() for p in self.outer_params],
                "optimizer": self.optimizer.state_dict(),
                "previous": None if self.previous is None else self.previous.clone(),
                "pending": pending}

    def load_state_dict(self, state: dict) -> None:
        if state["numels"] != self.numels or state["mode"] != self.mode:
            raise ValueError(f"DiLoCo state for mode {state['mode']} and {len(state['numels'])} tensors does not fit "
                             f"mode {self.mode} and {len(self.numels)} tensors; was the model, ZeRO stage or "
                             "island size changed?")
        with torch.no_grad():
            for p, saved in zip(self.outer_params, state["outer_params"]):
                p.copy_(saved)
            if self.previous is not None and state.get("previous") is None:  # the earlier delayed mode
                self._convert_shared_theta(state["anchor"])
            elif self.previous is not None:
                self.previous.copy_(state["previous"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.outer_step = state["outer_step"]
        self.pending = _Resolved(state["pending"]) if state["pending"] is not None else None

    @torch.no_grad()
    def _convert_shared_theta(self, anchor: list[torch.Tensor]) -> None:
        """A state of the earlier delayed mode, its shared theta_outer already loaded: the island went
        on from `anchor` = theta_outer - previous / n, which becomes the island's own theta_outer."""
        anchor = [a.to(p.device) for a, p in zip(anchor, self.outer_params)]
        self.previous.copy_(_flatten([(p - a) * self.islands for p, a in zip(self.outer_params, anchor)]))
        for p, a in zip(self.outer_params, anchor):
            p.copy_(a)

    def restart(self) -> None:
        """Start the outer loop afresh from the current weights (a checkpoint saved without DiLoCo)."""
        self._adopt_island0_weights()
        masters = self.weights.tensors()
        with torch.no_grad():
            for p, m in zip(self.outer_params, masters):
                p.copy_(m)
            if self.previous is not None:
                self.previous.zero_()
        self.optimizer = self._make_optimizer(self.outer_params)
        self.pending, self.outer_step = None, 0

    def check_same_step(self, step: int) -> None:
        """Raise unless every island resumed at the same step."""
        if self.group is None:
            return
        t = torch.tensor([step, -step], dtype=torch.float64)
        self.group.allreduce([t], dist.ReduceOp.MAX).wait()
        if t[0] != -t[1]:
            raise RuntimeError(f"islands resumed from different steps ({int(-t[1])} to {int(t[0])}); "
                               "resume every island from the same checkpoint step")

    def close(self) -> None:
        """Wait for every island after the last outer step (so the store outlives its users)."""
        self.topology.barrier()


class _Resolved:
    """A finished exchange restored from a checkpoint."""

    seconds = hidden_seconds = 0.0

    def __init__(self, average: torch.Tensor):
        self.average = average

    def result(self) -> torch.Tensor:
        return self.average


def _flatten(tensors) -> torch.Tensor:
    """One contiguous fp32 CPU vector (gloo exchanges CPU tensors)."""
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def _island_reduce(values: list[float], op) -> list[float]:
    """Reduce a few numbers over this island's world (no-op without one)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    from dragon.distributed import _device

    t = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=op)
    return t.cpu().tolist()
