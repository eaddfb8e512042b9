"""The arrows run one way: the kernel library imports torch and triton only, never the model glue (`hermes`) nor
transformers, and every op works in a process where both are unimportable."""
import ast
import pathlib
import subprocess
import sys
import textwrap

import hermes_kernels
from tests.utils import REPO

PACKAGE = pathlib.Path(hermes_kernels.__file__).parent
FORBIDDEN = ("hermes", "transformers")

# a fresh interpreter in which `import hermes...` and `import transformers...` fail; it imports every module of the
# kernel library and runs one step of each policy on CPU tensors, with the interpreter's Triton for one op
ISOLATED = textwrap.dedent("""
    import importlib, os, pkgutil, sys
    os.environ.setdefault("TRITON_INTERPRET", "1")

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {forbidden!r}:
                raise ImportError(f"{{name}} is not importable in this test")

    sys.meta_path.insert(0, Refuse())
    import torch
    import hermes_kernels as hk
    for info in pkgutil.walk_packages(hk.__path__, prefix="hermes_kernels."):
        importlib.import_module(info.name)

    L, B, Hkv, N, D, P = 4, 1, 2, 40, 16, 3
    cfg = hk.HermesConfig.llava_ov(num_layers=L, budget=20, prefix_len=P, reindex="eager")
    keys, values = torch.randn(2, L, B, Hkv, N, D).unbind(0)
    positions = torch.arange(N).repeat(L, B, 1)
    inv_freq = 1.0 / 1e4 ** (torch.arange(0, D, 2) / D)
    attn = hk.pooled_attention(torch.randn(L, B, 4, 5, D), keys, backend="triton")[:, :, P:]
    out = hk.compress_step(keys, values, positions, attn, cfg, inv_freq, backend="torch")
    assert out.length == P + 20 and bool(out.reindexed)

    h2 = hk.H2SVCConfig.llava_ov(num_layers=L, num_kv_heads=Hkv, prefix_len=P, tokens_per_frame=2,
                                 episodic_frames=3)
    rows, W, F = h2.num_rows(hk.EPISODIC), 3, 2
    C = P + (W + F) * 2
    k, v = torch.randn(2, rows, B, C, D).unbind(0)
    features = hk.frame_features(v[:, :, P:P + W * 2], 2)
    step = hk.h2svc_step(k, v, torch.arange(C).repeat(rows, B, 1), torch.arange(W).repeat(rows, B, 1), h2,
                         hk.EPISODIC, inv_freq, features=features, backend="torch",
                         clock=hk.StreamClock(held=W, num_frames=F, first_frame=W, reindexed=torch.tensor(True),
                                              next_position=C))
    assert step.held == W
    loaded = sorted(name for name in sys.modules if name.split(".")[0] in {forbidden!r})
    assert not loaded, loaded
    print("isolated ok")
""").format(forbidden=FORBIDDEN)


def test_no_module_of_the_kernel_library_imports_the_glue_or_transformers():
    """Every import statement under hermes_kernels/ names torch, triton, the standard library or the library
    itself (relative imports)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            offenders += [f"{path.relative_to(PACKAGE)}:{node.lineno} {name}" for name in names
                          if name.split(".")[0] in FORBIDDEN]
    assert not offenders, offenders


def test_the_kernel_library_imports_and_runs_without_hermes_and_transformers():
    done = subprocess.run([sys.executable, "-c", ISOLATED], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "isolated ok" in done.stdout
