"""One folder per policy, with the same file names in each: `config` (the policy's settings and presets),
`reference` (its plain PyTorch oracle), `checks` (the input checks of its ops), `ops` (its public ops), and the
kernels the ops dispatch to (HERMES: `pooling`, `scoring`, `select`, `compaction`; H2SVC: `features`, `stce`,
`step`)."""
