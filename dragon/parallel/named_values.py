"""Vectors over a rank's master weights (DiLoCo's theta_outer, its optimizer's moments), saved by
parameter name and read back on any layout.

A vector is saved as the universal checkpoint saves the weights: {name: [(neuron share, offset
in the flattened parameter, values)]}. A rank reads its values back by its own pieces of the
parameters (MasterWeights.segments), from its own save or from every rank's merged: the same cut
either way, a sharded parameter's neuron shares joined and cut again as the model's are
(dragon.parallel.neurons), data-parallel replicas read once.
"""

import math
from dataclasses import dataclass
from typing import Any

import torch

from dragon.parallel.neurons import SHARDED, join_shares, share_of


@dataclass
class RankLayout:
    """Where a rank's values sit: its master tensors' sizes, their pieces of the parameters
    (name, offset in the flattened parameter, offset in the tensor, numel), the parameters'
    shapes, its neuron share (index, K) and the model's config (where a share sits)."""

    numels: list[int]
    segments: list
    shapes: dict
    share: tuple[int, int] = (0, 1)
    config: Any = None

    @classmethod
    def of(cls, weights, numels: list[int]) -> "RankLayout":
        """A MasterWeights' layout; weights without names hold one piece of a parameter named
        by its index per tensor."""
        share = getattr(weights, "neuron_share", lambda: (0, 1))()
        if not hasattr(weights, "segments"):
            return cls(numels, [[(str(i), 0, 0, n)] for i, n in enumerate(numels)],
                       {str(i): (n,) for i, n in enumerate(numels)}, share)
        return cls(numels, weights.segments(), weights.shapes(), share,
                   getattr(weights, "config", None))

    def by_name(self, flat: torch.Tensor) -> dict:
        """`flat` (over this rank's values) as {name: [(neuron share, offset, values)]}."""
        named: dict = {}
        for pieces, tensor in zip(self.segments, flat.split(self.numels)):
            for name, at, offset, count in pieces:
                named.setdefault(name, []).append(
                    (self.share[0], at, tensor[offset:offset + count]))
        return named

    def flat(self, named: dict, saved_shares: int, what: str) -> torch.Tensor:
        """This rank's values (0 in ZeRO's padding) of `named`, saved by `saved_shares` neuron
        shares; ValueError in one line naming `what` when a piece is missing."""
        out, base = torch.zeros(sum(self.numels)), 0
        for pieces, numel in zip(self.segments, self.numels):
            for name, at, offset, count in pieces:
                saved = named.get(name, [])
                if name in SHARDED and saved_shares != self.share[1]:
                    saved = [(0, 0, self._rejoined(saved, name, saved_shares, what))]
                else:  # this rank's share of a sharded parameter; any one of a replicated one
                    j = self.share[0] if name in SHARDED else min((p[0] for p in saved),
                                                                  default=0)
                    saved = [p for p in saved if p[0] == j]
                out[base + offset:base + offset + count] = _span(saved, at, count, what, name)
            base += numel
        return out

    def _rejoined(self, pieces: list, name: str, saved_shares: int, what: str) -> torch.Tensor:
        """This rank's share of sharded parameter `name`, from the `saved_shares` shares."""
        c = self.config
        whole = torch.empty((c.n_head * c.n_neurons, c.n_embd) if name.endswith("decoder") else
                            (c.n_head, c.n_embd, c.n_neurons), device="meta")
        shares = []
        for j in range(saved_shares):
            shape = share_of(name, whole, c, j, saved_shares).shape
            values, found = torch.zeros(math.prod(shape)), torch.zeros(math.prod(shape), dtype=bool)
            for _, at, piece in (p for p in pieces if p[0] == j):
                values[at:at + piece.numel()], found[at:at + piece.numel()] = piece, True
            if not found.all():
                _missing(what, name, int((~found).nonzero()[0]))
            shares.append({name: values.view(shape)})
        return share_of(name, join_shares(shares, c)[name], c, *self.share).reshape(-1)


def _span(pieces: list, at: int, count: int, what: str, name: str) -> torch.Tensor:
    """Values [at, at + count) of a parameter out of its saved pieces (replicas read once)."""
    values, end = [], at
    for _, start, t in sorted(pieces, key=lambda p: p[1]):
        if start <= end < min(start + t.numel(), at + count):
            values.append(t[end - start:min(start + t.numel(), at + count) - start])
            end += values[-1].numel()
    if end != at + count:
        _missing(what, name, end)
    return torch.cat(values) if values else torch.zeros(0)


def merged(saves: list[dict]) -> dict:
    """Every rank's {name: pieces} as one, which RankLayout.flat cuts any rank's values from."""
    out: dict = {}
    for named in saves:
        for name, pieces in named.items():
            out.setdefault(name, []).extend(pieces)
    return out


def _missing(what: str, name: str, at: int) -> None:
    raise ValueError(f"{what} lacks the values of {name} from offset {at} on; a rank's file is "
                     "missing, or the model is not the one it was saved with")
