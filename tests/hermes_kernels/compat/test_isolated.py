"""The adapter in a process where transformers and the model glue are unimportable (the environment of the released
code's users who install the kernel library alone): `hermes_kernels.compat` imports, accelerates a stand-in of each
released class and streams chunks with the same results as the stand-in (the pattern of
tests/hermes_kernels/test_imports.py)."""
import subprocess
import sys
import textwrap

from tests.utils import REPO

FORBIDDEN = ("hermes", "transformers")

ISOLATED = textwrap.dedent("""
    import sys
    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {forbidden!r}:
                raise ImportError(f"{{name}} is not importable in this test")

    sys.meta_path.insert(0, Refuse())
    import torch
    torch.set_num_threads(1)
    import hermes_kernels.compat as compat
    from scaffolding import standin
    from tests.hermes_kernels.compat.cases import Case, drive

    for kind, container in (("llava_ov", "list"), ("qwen2_5_vl", "layered")):
        ref, fast, handle, keeps, worst = drive(Case(kind, torch.float32, True, container, chunks=4))
        assert handle.stats["shrinks"] == 3 and len(keeps) == 3, handle.stats
        print(kind, "max key error", f"{{worst:.1e}}", "keep sets equal", True)
    loaded = sorted(name for name in sys.modules if name.split(".")[0] in {forbidden!r})
    assert not loaded, loaded
    print("isolated compat ok")
""").format(forbidden=FORBIDDEN)


def test_the_adapter_imports_and_runs_without_transformers_and_the_glue():
    done = subprocess.run([sys.executable, "-c", ISOLATED], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "isolated compat ok" in done.stdout
