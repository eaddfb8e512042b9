"""The model glue without its one extra dependency: `import hermes` (and so the `hermes` commands) fails with a
message that says what to install, in a process where transformers is unimportable."""
import subprocess
import sys
import textwrap

from tests.utils import REPO

WITHOUT_TRANSFORMERS = textwrap.dedent("""
    import sys
    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "transformers":
                raise ImportError(f"{name} is not importable in this test")
    sys.meta_path.insert(0, Refuse())
    try:
        import hermes.cli
    except ImportError as error:
        print("refused:", error)
    import hermes_kernels  # the kernel library still imports
    print("kernels ok")
""")


def test_the_glue_says_to_install_the_model_extra_when_transformers_is_missing():
    done = subprocess.run([sys.executable, "-c", WITHOUT_TRANSFORMERS], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "refused: hermes (the model glue, its commands and HermesStream) needs transformers: " \
           "pip install 'hermes-kernels[model]'" in done.stdout
    assert "kernels ok" in done.stdout
