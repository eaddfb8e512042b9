"""The model glue over `hermes_kernels`: the policies' `transformers` caches, the one registered attention
function, the streaming front, the model families, video decoding, the CLI and the H2SVC head profiler
(docs/index.md). It needs transformers; the kernel library does not.

The names most users need are re-exported here (docs/api.md lists every public path).
"""
try:
    import transformers  # noqa: F401  (the glue's one dependency beyond the kernel library's)
except ImportError as missing:  # the `hermes` commands and `import hermes` say what to install, not a traceback
    raise ImportError("hermes (the model glue, its commands and HermesStream) needs transformers: "
                      "pip install 'hermes-kernels[model]'; the kernel library hermes_kernels does not") from missing

from hermes.policies.h2svc.cache import H2SVCCache
from hermes.policies.hermes.cache import HermesCache
from hermes.stream import HermesStream
from hermes_kernels import CompressResult, H2SVCConfig, HermesConfig

__all__ = ["HermesConfig", "H2SVCConfig", "HermesStream", "HermesCache", "H2SVCCache", "CompressResult"]
