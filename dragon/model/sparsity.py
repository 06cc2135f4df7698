"""How sparse BDH's activations are: per layer, the fraction of positive entries of x = ReLU(v @
encoder), y = ReLU(LN(a) @ encoder_v) and their product x * y, seen through forward hooks on the
shared layer (the model code is unchanged). Every layer runs the same BDHLayer module, so the
hooks tell the layers apart by counting its calls: x then y, then the product, per layer."""

import torch
from torch import nn

from dragon.model.bdh import BDHLayer

KINDS = ("x", "y", "xy")


class SparsityProbe:
    """Inside `with SparsityProbe(model) as probe:` every forward of `model` adds, per layer, the
    fraction of positive x, y and x * y entries; `fractions()` is their mean over the forwards
    (equal-size batches weigh the same). `first_layer` numbers a pipeline stage's layers."""

    def __init__(self, model: nn.Module, n_layer: int, first_layer: int = 0):
        self.layers = [m for m in model.modules() if isinstance(m, BDHLayer)]
        self.n_layer, self.first_layer = n_layer, first_layer
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.calls, self.handles = 0, []

    def __enter__(self) -> "SparsityProbe":
        for layer in self.layers:
            self.handles.append(layer.sparse.register_forward_hook(self._activation))
            self.handles.append(layer.drop.register_forward_hook(self._product))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _activation(self, module, inputs, output: torch.Tensor) -> None:
        layer, kind = divmod(self.calls, 2)
        self._add(layer, KINDS[kind], output)
        self.calls += 1

    def _product(self, module, inputs, output: torch.Tensor) -> None:
        self._add(self.calls // 2 - 1, "xy", inputs[0])  # before dropout
        if self.calls == 2 * self.n_layer:  # the forward's last layer: the next starts afresh
            self.calls = 0

    def _add(self, layer: int, kind: str, t: torch.Tensor) -> None:
        key = f"sparsity/layer{self.first_layer + layer % self.n_layer}/{kind}"
        self.sums[key] = self.sums.get(key, 0.0) + float((t > 0).float().mean())
        self.counts[key] = self.counts.get(key, 0) + 1

    def fractions(self) -> dict[str, float]:
        """{"sparsity/layer<i>/<x|y|xy>": the mean fraction of positive entries}."""
        return {key: self.sums[key] / self.counts[key] for key in sorted(self.sums)}
