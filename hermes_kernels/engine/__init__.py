"""The engine under the ops (docs/layout.md): the one dispatch point and launch point, the dtypes and generic
input checks, the native build of the C loops and their typed bindings, the row movers and dense ranks both
policies' in-place steps use, scratch memory, correctly rounded division, the model geometry and the GPU
compile-spec registry. Importable, not in `hermes_kernels.__all__` (docs/api.md lists the paths)."""
