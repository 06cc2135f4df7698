"""DiLoCo: islands that train apart and meet every H steps for an outer step.

- arguments, config: the --diloco_* command-line arguments, and the DiLoCoConfig they give
- build: outer_loop(engine, ...), the outer loop a recipe runs (DiLoCo or FragmentedDiLoCo)
- outer: DiLoCo, the outer loop of one rank over the whole model
- fragments, fragment_cut: streaming DiLoCo, the weights in fragments synced in turn
- runtime: what both outer loops run on (weights, membership, codec, exchange thread, metrics)
- membership: which islands take part in an outer step (a fixed group, or elastic islands)
- codecs: fp32, bf16, int8, int4, top-k; quantized, sparse: the int4 and top-k number formats
- exchange: the transport of one exchange among islands, and the interface every exchange has
- background: the thread the exchanges of delayed mode run on, and the link watch
- landing: when a fragment in flight lands (a fixed delay, or auto: agreed in the store)
- metrics: what an outer step reports
- state: DiLoCo's state in a checkpoint, and its re-layout for another partition
- master_weights: this rank's fp32 master weights inside any DeepSpeed engine
- island_store: `python -m dragon.diloco.island_store`, a store that outlives every island
"""
