"""HERMES on a model (docs/hermes.md): `policy` (`HermesPolicy`, the streaming front's default), `cache`
(`HermesCache`: one stacked K/V buffer per device, compressed in place), `attention` (the layer's rotation and its
guidance pooling) and `guidance` (the guidance prompts and their pass). The policy's config, reference and
kernels are in the kernel library, `hermes_kernels.policies.hermes`."""
