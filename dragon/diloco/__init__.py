"""DiLoCo: islands that train apart and meet every H steps for an outer step.

- arguments: the --diloco_* command-line arguments (DiLoCoArguments)
- build: outer_loop(engine, ...), the outer loop a recipe runs (DiLoCo or FragmentedDiLoCo)
- outer: DiLoCo, the outer loop of one rank
- fragments: streaming DiLoCo, the weights in fragments synced in turn (--diloco_fragments)
- exchange: one exchange of a flat pseudo-gradient among islands (fp32, bf16, int8, int4, top-k)
- background: the thread the exchanges of delayed mode run on, and the link watch
- landing: when a fragment in flight lands (a fixed delay, or auto: agreed in the store)
- quantized, sparse: the int4 code's all-reduce, top-k with error feedback
- membership, elastic: elastic islands, the quorum of each outer step, joining a live run
- state: DiLoCo's state in a checkpoint, and its re-layout for another partition
- master_weights: this rank's fp32 master weights inside any DeepSpeed engine
- island_store: `python -m dragon.diloco.island_store`, a store that outlives every island
"""
