"""The model glue over `hermes_kernels`: the policies' `transformers` caches, the one registered attention
function, the streaming front, the model families, video decoding, the CLI and the H2SVC head profiler
(docs/index.md). It needs transformers; the kernel library does not.

The names most users need are re-exported here (docs/api.md lists every public path). They are imported on first
access, so `import hermes` and the commands' argument parsing import neither torch nor transformers: a refusal of
the command line answers at once (docs/cli.md).
"""
import importlib

# public name -> the module that defines it, imported on first access (`__getattr__`)
_EXPORTS = {"HermesConfig": "hermes_kernels", "H2SVCConfig": "hermes_kernels", "HermesStream": "hermes.stream",
            "HermesCache": "hermes.policies.hermes.cache", "H2SVCCache": "hermes.policies.h2svc.cache",
            "CompressResult": "hermes_kernels"}

__all__ = ["HermesConfig", "H2SVCConfig", "HermesStream", "HermesCache", "H2SVCCache", "CompressResult"]


def require_transformers() -> None:
    """Import transformers, the glue's one dependency beyond the kernel library's, or raise an ImportError that says
    what to install (the commands print it as their one error line), not a traceback of the first import that
    needed it."""
    try:
        import transformers  # noqa: F401
    except ImportError as missing:
        raise ImportError("hermes (the model glue, its commands and HermesStream) needs transformers: pip install "
                          "'hermes-kernels[model]'; the kernel library hermes_kernels does not") from missing


def __getattr__(name: str):
    """A public name (`__all__`), imported from its module on first access and kept; AttributeError otherwise (so
    `from hermes import cli` still finds the submodule)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hermes' has no attribute {name!r}")
    require_transformers()
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
