"""H2SVC on a model (docs/h2svc.md): `policy` (`H2SVCPolicy`, `HermesStream(..., policy="h2svc")`), `cache`
(`H2SVCCache`: one K/V block per class and device, the step after every chunk), `attention` (one dense call per
class, frame-window masks), `head_map` (the map file: save, load, check against a model) and `profile` (the
offline head profiler, `hermes-profile`). The policy's config, reference and kernels are
in the kernel library, `hermes_kernels.policies.h2svc`."""
