"""One island of two, on toy weights, for tests/test_background.py: every codec, the whole model
and 4 fragments, in delayed mode, with the exchange on its own thread and without it.

    python background_islands.py ISLAND HOST:PORT OUT_JSON

Two processes meet through real gloo groups (dragon.parallel.topology.enter_island, one launch
per island; each outer loop made with the exchange thread adds a gloo group of its own). The inner
steps are diloco_islands.py's gradient steps towards an island's own centre. Each run records the
weights and theta_outer after every inner step, and the metrics; then an `auto` run of 4
fragments records its landings.
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parent))
import diloco_islands as toy  # noqa: E402

from dragon.run.diloco_args import DiLoCoArguments  # noqa: E402
from dragon.diloco.outer import DiLoCo  # noqa: E402
from dragon.parallel.topology import enter_island  # noqa: E402

H, F, STEPS = 4, 4, 12
CODECS = {"none": {}, "bf16": dict(diloco_compress="bf16"),
          "int8": dict(diloco_compress="int8", diloco_int8_block=256),
          "int4": dict(diloco_compress="int4", diloco_int8_block=256),
          "topk": dict(diloco_topk=0.05)}


def run(island: int, topology, options: dict) -> list[dict]:
    args = DiLoCoArguments(diloco_inner_steps=H, diloco_mode="delayed", diloco_islands=2,
                           diloco_outer_lr=1.0, diloco_outer_momentum=0.3, **options)
    weights = toy.Weights(toy.initial_weights())
    config = args.config()
    if config.fragments > 1:  # the toy has no BDH parameters: fragments are runs of values
        ids = (torch.arange(1000) * F // 1000).to(torch.int8)
        outer = DiLoCo(weights, config, topology, ids=ids)
    else:
        outer = DiLoCo(weights, config, topology)
    c, record = toy.centre(island), []
    for step in range(1, STEPS + 1):
        toy.inner_steps(weights, c)
        metrics = outer.maybe_outer_step(step, final=step == STEPS)
        record.append(dict(toy.record_of(weights, outer, metrics), step=step))
    outer.close()
    return record


def main():
    island, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    topology = enter_island(SimpleNamespace(
        diloco_islands=2, diloco_island_index=island, diloco_store=store,
        diloco_store_external=False, diloco_elastic=False), 60)
    results = {}
    for codec, options in CODECS.items():
        for fragments in (1, F):
            more = dict(diloco_fragments=F, diloco_fragment_delay="1") if fragments > 1 else {}
            for thread in (False, True):
                name = f"{codec}-f{fragments}-{'thread' if thread else 'inline'}"
                results[name] = run(island, topology, dict(options, diloco_exchange_thread=thread,
                                                           **more))
    results["auto"] = run(island, topology, dict(CODECS["int4"], diloco_fragments=F))
    topology.barrier()
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
