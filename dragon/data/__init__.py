"""Text in, packed token blocks out, deterministic batches per data-parallel rank.

- text: DataArguments, the tokenizers, load_text, pack, build_datasets (materialised datasets)
- sources: local files as the command line names them (resolve_files)
- streaming: --streaming (build_streams, StreamingBatches, a resumable shuffle buffer)
- mixture: --dataset_mixture, weighted streamed sources
- batches: TrainBatches, ContiguousRowBatches (rows that continue a carried state),
  eval_batches, eval_streams
"""
