"""DiLoCo: islands that train apart and meet every H steps for an outer step. How a pseudo-gradient
travels among them (codecs, exchanges, the exchange thread) is dragon.wire.

- config: DiLoCoConfig, what the --diloco_* arguments give (dragon.run.diloco_args)
- build: outer_loop(engine, ...), the outer loop a recipe runs over the engine's master weights
- outer, runtime: DiLoCo, the outer loop of one rank, and what it runs on
- fragment, fragment_cut: the parts of the weights that meet in turn, and BDH's cut into them
- membership, quorum: which islands take part in an outer step (a fixed group, or elastic)
- landing, pace: when a fragment in flight lands; islands of unequal speed
- outer_metrics, link_watch: what an outer step reports; when the link is slower than its window
- state: DiLoCo's state in a checkpoint
- island_store: `python -m dragon.diloco.island_store`, a store that outlives every island"""
