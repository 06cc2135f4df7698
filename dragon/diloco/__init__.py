"""DiLoCo: islands that train apart and meet every H steps for an outer step.

- config: DiLoCoConfig, what the --diloco_* arguments give (dragon.run.diloco_args)
- build: outer_loop(engine, ...), the outer loop a recipe runs over the engine's master weights
- outer, runtime: DiLoCo, the outer loop of one rank, and what it runs on
- fragment, fragment_cut: the parts of the weights that meet in turn, and BDH's cut into them
- membership, quorum: which islands take part in an outer step (a fixed group, or elastic)
- codecs, quantized, sparse: how a pseudo-gradient goes on the wire (fp32 to int4, top-k)
- exchange, background: one exchange among islands, and the thread delayed mode runs it on
- landing, pace: when a fragment in flight lands; islands of unequal speed
- metrics, state: what an outer step reports; DiLoCo's state in a checkpoint
- island_store: `python -m dragon.diloco.island_store`, a store that outlives every island"""
