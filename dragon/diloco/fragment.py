"""One fragment of the weights: the part of this rank's values that meets the other islands on
its own schedule, with its theta_outer, outer optimizer, top-k residual and exchange in flight
(streaming DiLoCo: F of them, dragon.diloco.fragment_cut). Delayed, a streaming fragment lands in
its window, merged; plain DiLoCo's lands when it syncs again (DiLoCo.eager_gradient)."""

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from dragon.wire.exchange import AnyExchange

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


@dataclass
class InFlight:
    """A fragment's exchange in flight and its landing step (auto: None until the islands agree)."""

    exchange: AnyExchange
    lands_at: Optional[int]
    synced_at: int = 0
    delta: Optional[torch.Tensor] = None  # what this island sent, for a redo without a lost one
    contributed: bool = True  # this island's own (a joiner sends zeros)
    share: int = 0  # how many islands' pseudo-gradients it averages (0: every island's)


class Fragment:
    """This rank's values whose byte in `ids` (shared by the fragments) is `number` (ids None: all);
    `numels`: its vector's tensors as the codec blocks them (default one); `values`: its weights."""

    def __init__(self, number: int, ids: Optional[torch.Tensor], numels: Optional[list[int]],
                 values: torch.Tensor, device: torch.device, make_optimizer: OptimizerFactory,
                 topk: bool, decay: float = 1.0):
        self.number, self.ids, self.decay = number, ids, decay
        self.numels = numels or [values.numel()]
        self.outer = values.to(device, torch.float32, copy=True)  # theta_outer
        self.make_optimizer = make_optimizer
        self.optimizer = make_optimizer([self.outer])
        self.residual = torch.zeros(values.numel()) if topk else None
        self.in_flight: Optional[InFlight] = None

    @property
    def mask(self) -> Optional[torch.Tensor]:
        """Which of this rank's values are in this fragment (None: all; made when used)."""
        return None if self.ids is None else self.ids == self.number

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        """This fragment's values out of a vector over all of this rank's values."""
        return flat if self.ids is None else flat[self.mask]

    def place(self, flat: torch.Tensor, values: torch.Tensor) -> None:
        """Put this fragment's `values` in their places in `flat`."""
        if self.ids is None:
            flat.copy_(values.reshape(-1))
        else:
            flat[self.mask] = values

    def delta(self, local: torch.Tensor, scale: float = 1.0,
              kept: Optional[torch.Tensor] = None) -> torch.Tensor:
        """scale (theta_outer - theta) plus what top-k kept back (SparseLoCo: decayed); `scale`
        weighs by tokens or staleness, `kept` is theta_outer - theta as a late island kept it."""
        delta = self.pseudo_gradient(local) if kept is None else kept.clone()
        if scale != 1:
            delta *= scale
        if self.residual is not None:
            delta += self.residual if self.decay == 1 else self.decay * self.residual
        return delta

    def pseudo_gradient(self, local: torch.Tensor) -> torch.Tensor:
        """theta_outer - theta, in fp32 on the CPU (`local`: this rank's values, flat)."""
        return self.outer.to("cpu", torch.float32) - self.of(local)

    def step(self, gradient: torch.Tensor) -> None:
        """One step of the outer optimizer on theta_outer with `gradient`."""
        self.outer.grad = gradient.to(self.outer.device)
        self.optimizer.step()
        self.outer.grad = None

    def merged(self, local: torch.Tensor, alpha: float) -> torch.Tensor:
        """alpha theta + (1 - alpha) theta_outer: what this fragment's weights become."""
        outer = self.outer.to("cpu", torch.float32)
        return alpha * self.of(local) + (1 - alpha) * outer if alpha else outer

    def sent_delta(self) -> torch.Tensor:
        """What this island sent in its exchange in flight (zeros: none of its own)."""
        x = self.in_flight
        if x is None or x.delta is None or not x.contributed:
            return torch.zeros(self.outer.numel())
        return x.delta.clone()

    def restart(self, values: torch.Tensor) -> None:
        """Afresh from `values`: nothing stepped, kept back or in flight."""
        with torch.no_grad():
            self.outer.copy_(values)
        self.optimizer = self.make_optimizer([self.outer])
        self.in_flight = None
        self.forget_own_share()

    def forget_own_share(self) -> None:
        """Nothing of this island's own is held back or in flight (a joiner, or a new island
        resumed from island 0's state)."""
        if self.residual is not None:
            self.residual.zero_()
        if self.in_flight is not None:
            self.in_flight.contributed = False
            if self.in_flight.delta is not None:
                self.in_flight.delta.zero_()


def placed(fragments: list, numels: list[int], values_of: Callable) -> torch.Tensor:
    """values_of(fragment) of every fragment, placed among this rank's values (0 where None)."""
    whole = torch.zeros(sum(numels))
    for fragment in fragments:
        values = values_of(fragment)
        if values is not None:
            fragment.place(whole, values.to("cpu", torch.float32))
    return whole
