"""Checkpoints: what a save holds, which saves are kept, and how they are read back.

- checkpointer: save and resume through engine.save_checkpoint / load_checkpoint, RNG state
- save_hook: the hook around engine.save_checkpoint (attach_retention): rank files, DeepSpeed's
  save, every rank or none (writes: GuardedWrites, SaveFailed), its marker, the prune
- retention: the policy (keep the last K plus the best) and the prune
- catalog: which checkpoints a directory holds, complete and whole (verify: the marker's file
  sizes and CRC-32s), find_resume_checkpoint
- resolver: the checkpoint a path names, for a resume and for every tool
- background_saves, writer, stream: --save_async (the writer process, checksummed streaming)
- reshape, universal, pipeline_files, neuron_shares: resume on another layout (data-parallel
  size, ZeRO stage, pipeline or plain model, neuron shares)
- read_model: the fp32 model a checkpoint of any layout holds
- export, card: a Hugging Face directory and its model card from an engine or a checkpoint
"""
