"""An outer step's metrics (each island's metrics.jsonl), summed or maxed over the island's ranks
in one small all-reduce each. Streaming DiLoCo logs each step where a fragment syncs or lands
(outer_step counts them); unequal islands add the metrics of dragon.diloco.pace.Pace.agree.

outer_bytes_sent: what the exchanges started at this step send, the most of any rank of the
island (sync: measured from /proc/self/io around the blocking exchange; delayed: the ring model
of dragon.wire.exchange.ring_bytes, the last step's average of theta_outer included).
outer_grad_norm: of the averages applied at this step, over the whole model (delayed: the late
one, absent at the first step). outer_comm_seconds: start to completion of their exchanges;
delayed, outer_comm_hidden_seconds is its part under inner steps and outer_wait_seconds what the
training thread waited (a save's wait included). --diloco_checksum adds float64 sums and sums of
squares of the working weights and theta_outer, equal bits on every island after a sync step."""

import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

from dragon.diloco.fragment import placed
from dragon.parallel.distributed import all_reduce_values


class OuterMetrics:
    """What an outer loop reports of its steps; `peak_bytes`: the most any outer step before the
    last sent (saved with the outer loop's state)."""

    def __init__(self, weights, config, numels: list[int]):
        self.weights, self.config, self.numels = weights, config, numels
        self.peak_bytes = 0

    def of_rounds(self, rounds: list, fragments: list, step: int, final: bool,
                  island: int) -> dict:
        """An outer step's metrics from its rounds (dragon.diloco.membership.Round: a fragment
        that lands and syncs at once has a round of each), over this rank's `fragments`."""
        metrics, done, F = {}, rounds[-1], len(fragments)
        averages, flights, applied = {}, [], []
        for r in rounds:
            averages.update(r.landed)
            averages.update(r.synced)
            flights += r.flights
            applied += [x.exchange for x in r.flights]
            applied += r.started if r.synced else []
            metrics.update(r.paced)  # unequal islands
            if r.late:  # islands landing late, and by how many outer steps this one is
                metrics["outer_late"] = len(r.late)
                if island in r.late:
                    metrics["landed_late_by"] = r.late[island]
        if F > 1:
            if done.syncing:  # the one that syncs; F: all of them (the last step)
                metrics["outer_fragment"] = F if final else done.syncing[0]
            if averages:  # the first that lands
                metrics["outer_landed"] = F if final else min(averages)
            if flights and not final:
                metrics["outer_landed_after"] = step - flights[0].synced_at
        average = (placed(fragments, self.numels, lambda f: averages.get(f.number))
                   if averages else None)
        residual = None
        if fragments[0].residual is not None:
            residual = placed(fragments, self.numels, lambda f: f.residual)
        metrics.update(self.of_step(done.started, applied, average, final, residual,
                                    lambda: placed(fragments, self.numels,
                                                   lambda f: f.outer.detach())))
        return metrics

    def of_step(self, started: list, applied: list, average: Optional[torch.Tensor],
                final: bool, residual: Optional[torch.Tensor],
                outer_flat: Callable[[], torch.Tensor]) -> dict:
        """An outer step's bytes, errors, norms and times: of the exchanges `started`, and of
        those `applied`, whose averages this step applied (`average`: them placed over this
        rank's values, None: none). The peak leaves out the last step, which sends everything
        at once by design."""
        metrics = {}
        sums = [sum(e.error_sq for e in started), sum(e.norm_sq for e in started),
                0.0 if average is None else self.norm_sq(average)]
        if self.config.checksum:
            sums += self.weights.fingerprint() + self._fingerprint(outer_flat())
        if residual is not None:
            sums.append(self.norm_sq(residual))
        sums = all_reduce_values(sums, dist.ReduceOp.SUM)
        bytes_sent = float(sum(e.bytes_sent for e in started))
        bytes_max = all_reduce_values([bytes_sent], dist.ReduceOp.MAX)[0]
        if not final:
            self.peak_bytes = max(self.peak_bytes, int(bytes_max))
        metrics.update(outer_bytes_sent=int(bytes_max), outer_peak_bytes=self.peak_bytes,
                       outer_payload_bytes=sum(e.payload_bytes for e in started))  # this rank's
        if self.config.compress != "none":
            metrics["outer_compress_error"] = math.sqrt(sums[0] / sums[1]) if sums[1] > 0 else 0.0
        if residual is not None:
            metrics["outer_residual_norm"] = math.sqrt(sums[-1])
        if average is not None:
            metrics["outer_grad_norm"] = math.sqrt(sums[2])
            metrics["outer_comm_seconds"] = sum(e.seconds for e in applied)
            if self.config.mode == "delayed":
                metrics["outer_comm_hidden_seconds"] = sum(e.hidden_seconds for e in applied)
                metrics["outer_wait_seconds"] = sum(e.blocked for e in applied)
        if self.config.checksum:
            metrics.update(weights_sum=sums[3], weights_sumsq=sums[4], outer_sum=sums[5],
                           outer_sumsq=sums[6])
        return metrics

    def counted(self, flat: torch.Tensor) -> torch.Tensor:
        """`flat` (over this rank's master tensors) without the copies another rank counts."""
        excluded = getattr(self.weights, "excluded", [])
        if not excluded:
            return flat
        offsets = [0]
        for n in self.numels:
            offsets.append(offsets[-1] + n)
        keep = torch.ones(flat.numel(), dtype=torch.bool)
        for k, start, numel in excluded:
            keep[offsets[k] + start: offsets[k] + start + numel] = False
        return flat[keep]

    def norm_sq(self, flat: torch.Tensor) -> float:
        """This rank's share of the squared norm of a flat pseudo-gradient (copies counted once)."""
        counted = self.counted(flat)
        return float(torch.dot(counted, counted)) / getattr(self.weights, "replicas", 1)

    def _fingerprint(self, outer_flat: torch.Tensor) -> list[float]:
        """[sum, sum of squares] in float64 of theta_outer on this rank, copies counted once."""
        counted = self.counted(outer_flat).double()
        return [float(counted.sum()), float(counted.pow(2).sum())]
