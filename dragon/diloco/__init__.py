"""DiLoCo: islands that train apart and meet every H steps for an outer step.

- arguments, config: the --diloco_* command-line arguments, and the DiLoCoConfig they give
- build: outer_loop(engine, ...), the outer loop a recipe runs over the engine's master weights
- outer: DiLoCo, the outer loop of one rank: rounds among the islands over its fragments
- fragment: a part of the weights: its theta_outer, outer optimizer, residual, exchange in flight
- fragment_cut: streaming DiLoCo's cut of BDH into F fragments
- runtime: what the outer loop runs on (weights, membership, codec, exchange thread, metrics)
- membership: which islands take part in an outer step (a fixed group, or elastic islands)
- codecs: fp32, bf16, int8, int4, top-k; quantized, sparse: the int4 and top-k number formats
- exchange: the transport of one exchange among islands, and the interface every exchange has
- background: the thread the exchanges of delayed mode run on, and the link watch
- landing: when a fragment in flight lands (a fixed delay, or auto: agreed in the store)
- pace: islands of unequal speed: which steps an island trains, and its weight by tokens
- metrics: what an outer step reports
- state: DiLoCo's state in a checkpoint, and its re-layout for another partition
- island_store: `python -m dragon.diloco.island_store`, a store that outlives every island
"""
