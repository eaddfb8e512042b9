"""HERMES (docs/hermes.md): after every chunk, score each cached visual token per layer (recency in shallow layers,
guidance attention in deep ones, a blend between), smooth the scores across layers, keep a fixed budget per layer,
fold what deep layers drop into a summary token and re-index positions. The ops are `hermes_kernels.compress_step`
and its stages; import the modules of this folder for the config, the reference and the kernels."""
