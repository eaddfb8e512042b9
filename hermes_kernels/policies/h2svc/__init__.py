"""H2SVC (docs/h2svc.md): every (layer, KV head) is routed offline to one of three frame memories, INSTANT (FIFO
over W_s frames), SHORT (FIFO over W_w frames) or EPISODIC (semantic trajectory curvature eviction over N_e
frames); after every chunk each class block is stepped in place. The ops are `hermes_kernels.h2svc_step` and its
stages; import the modules of this folder for the config, the reference and the kernels."""
