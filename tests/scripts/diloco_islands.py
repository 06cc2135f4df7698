"""One island of a two-island DiLoCo run on toy weights, for tests/test_diloco.py.

    python diloco_islands.py ISLAND HOST:PORT OUT_JSON

Two processes (islands 0 and 1, one rank each) meet through a real ProcessGroupGloo built by
dragon.topology.enter_island (one launch per island). The "inner optimizer" is a gradient step
on a quadratic with an island-specific centre, so each island's progress depends on the weights
it starts from and the delayed schedule matters. Each scenario records, after every outer step,
the island's weights, theta_outer and the metrics, for the test to check against a hand simulation.
"""

import json
import sys
from types import SimpleNamespace

import torch

from dragon.diloco import DiLoCo, DiLoCoArguments
from dragon.topology import enter_island

SHAPES = [(20, 30), (400,)]  # two tensors, 1000 values
INNER_STEPS, OUTER_STEPS, INNER_LR = 3, 4, 0.3
SCENARIOS = [
    dict(diloco_mode="sync", diloco_compress="none"),
    dict(diloco_mode="delayed", diloco_compress="none"),
    dict(diloco_mode="sync", diloco_compress="bf16"),
    dict(diloco_mode="sync", diloco_compress="int8", diloco_int8_block=256),
    dict(diloco_mode="sync", diloco_compress="int8", diloco_int8_block=0),
    dict(diloco_mode="delayed", diloco_compress="int8", diloco_int8_block=256),
    # plain averaging, saved after outer step 2 in the format of the earlier delayed mode and loaded back
    dict(diloco_mode="delayed", diloco_compress="none", diloco_outer_lr=1.0, diloco_outer_momentum=0.0,
         convert_at=2),
]


def initial_weights():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g) for shape in SHAPES]


def centre(island):
    g = torch.Generator().manual_seed(100 + island)
    return [torch.randn(shape, generator=g) * (1 + island) for shape in SHAPES]


class Weights:
    """Plain fp32 tensors standing in for an engine's master weights."""

    replicas, excluded = 1, []

    def __init__(self, tensors):
        self.ts = tensors

    def tensors(self):
        return self.ts

    def publish(self):
        pass

    def fingerprint(self):
        return [float(sum(t.double().sum() for t in self.ts)), float(sum(t.double().pow(2).sum() for t in self.ts))]


def shared_theta_state(state: dict, numels: list[int], islands: int) -> dict:
    """A delayed-mode state as the earlier version saved it: one theta_outer shared by the islands,
    each island going on from its `anchor` = theta_outer - previous / n (plain averaging only)."""
    previous = state["previous"].split(numels)
    shared = [a + d.view_as(a) / islands for a, d in zip(state["outer_params"], previous)]
    return dict(state, previous=None, anchor=state["outer_params"], outer_params=shared)


def main():
    island, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    topology = enter_island(SimpleNamespace(diloco_islands=2, diloco_island_index=island, diloco_store=store), 60)
    c = centre(island)
    results = []
    for scenario in SCENARIOS:
        options = {k: v for k, v in scenario.items() if k != "convert_at"}
        args = DiLoCoArguments(diloco_islands=2, diloco_inner_steps=INNER_STEPS, diloco_island_index=island,
                               diloco_store=store, **options)
        weights = Weights(initial_weights() if island == 0 else [torch.zeros(s) for s in SHAPES])
        outer = DiLoCo(weights, args, topology)  # island 1 starts from zeros: the broadcast gives it theta_0
        record = []
        step = 0
        for k in range(1, OUTER_STEPS + 1):
            for _ in range(INNER_STEPS):
                step += 1
                with torch.no_grad():
                    for w, ci in zip(weights.tensors(), c):
                        w.sub_(INNER_LR * (w - ci))
                metrics = outer.maybe_outer_step(step, final=step == INNER_STEPS * OUTER_STEPS)
                assert bool(metrics) == (step % INNER_STEPS == 0), (step, metrics)
            record.append({"weights": [w.flatten().tolist() for w in weights.tensors()],
                           "outer": [p.flatten().tolist() for p in outer.outer_params],
                           "metrics": metrics})
            if k == scenario.get("convert_at"):
                old = shared_theta_state(outer.state_dict(), outer.numels, args.diloco_islands)
                saved = [w.clone() for w in weights.tensors()]
                outer = DiLoCo(weights, args, topology)  # as in a resume: then the checkpoint's weights
                with torch.no_grad():
                    for w, v in zip(weights.tensors(), saved):
                        w.copy_(v)
                outer.load_state_dict(old)
                record[-1]["old_outer"] = [p.flatten().tolist() for p in old["outer_params"]]
        results.append({"scenario": scenario, "outer_steps": record})
    topology.barrier()
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
