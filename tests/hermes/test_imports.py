"""What the glue imports, each in a fresh process: the commands answer --help, a bad option, a missing file, an
unknown policy and a refused --live source or setting without importing torch, transformers, triton or the kernel
library (their refusals answer at once: docs/cli.md#stream-a-video-file, "Start-up"), and import them once the
arguments are valid; without transformers the commands still parse and `from hermes import HermesStream` and a run
say what to install, while the kernel library imports."""
import json
import subprocess
import sys
import textwrap

import pytest

from tests.hermes.video_files import write_video
from tests.utils import REPO

HEAVY = ("torch", "transformers", "triton", "hermes_kernels")

# argv[1]: the command's module; argv[2]: its arguments (JSON). Prints its exit status, then the heavy packages loaded.
COMMAND = textwrap.dedent(f"""
    import importlib, json, sys
    main = importlib.import_module(sys.argv[1]).main
    try:
        status = main(json.loads(sys.argv[2]))
    except SystemExit as exit:
        status = exit.code
    print("status", status)
    print("heavy", json.dumps(sorted({{name.split(".")[0] for name in sys.modules}} & set({HEAVY!r}))))
""")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A readable clip and a folder that passes for a checkpoint until its config.json is read."""
    folder = tmp_path_factory.mktemp("inputs")
    (folder / "model").mkdir()
    (folder / "model" / "config.json").write_text("{}")
    return {"clip": write_video(folder / "clip.mp4", [i / 4 for i in range(8)]), "model": str(folder / "model"),
            "missing": str(folder / "missing.mp4")}


def command(module: str, argv: list[str]) -> tuple[int, list[str], str]:
    """(exit status, heavy packages imported, stderr) of `module`'s main(argv) in a fresh process."""
    done = subprocess.run([sys.executable, "-c", COMMAND, module, json.dumps(argv)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    status, heavy = done.stdout.splitlines()[-2:]
    return int(status.split()[1]), json.loads(heavy.split(" ", 1)[1]), done.stderr


@pytest.mark.parametrize("module,argv,status,message", [
    ("hermes.cli", ["--help"], 0, ""),
    ("hermes.profile_cli", ["--help"], 0, ""),
    ("hermes.cli", ["--model", "{model}", "--video", "{clip}", "--bogus"], 2, "error: unrecognized arguments: --bogus"),
    ("hermes.profile_cli", ["--model", "{model}"], 2, "error: the following arguments are required: --videos, --out"),
    ("hermes.cli", ["--model", "/nonexistent", "--video", "{missing}", "--question", "q"], 1,
     "error: video: no such file: {missing}"),
    ("hermes.cli", ["--model", "/nonexistent", "--video", "{clip}", "--question", "q"], 1,
     "error: model: no such folder: /nonexistent"),
    ("hermes.cli", ["--model", "{model}", "--video", "{clip}", "--question", "q", "--policy", "nope"], 2,
     "error: policy: expected one of ['h2svc', 'hermes'], got 'nope'"),
    ("hermes.cli", ["--model", "{model}", "--video", "{clip}", "--question", "q", "--fps", "0"], 2,
     "error: fps: expected a positive finite number"),
    ("hermes.cli", ["--model", "{model}", "--live", "ftp://host/feed"], 2, "error: live: --live expects a URL"),
    ("hermes.cli", ["--model", "{model}", "--live", "/dev/video99"], 2,
     "error: live: --live /dev/video99: no such capture device"),
    ("hermes.cli", ["--model", "{model}", "--live", "-", "--max-lag", "0.5"], 2,
     "error: max_lag: a chunk of 16 frames at 1 fps takes 15 s to arrive"),
], ids=["help", "profile-help", "bad-option", "profile-missing-option", "missing-video", "missing-model",
        "unknown-policy", "bad-setting", "live-scheme", "live-device", "live-setting"])
def test_a_refusal_imports_nothing_heavy(module, argv, status, message, inputs):
    got, heavy, err = command(module, [arg.format(**inputs) for arg in argv])
    assert (got, heavy) == (status, []), err
    assert message.format(**inputs) in err


def test_valid_arguments_import_the_libraries_they_need(inputs):
    """The same process past the checks that need nothing heavy: transformers reads the (empty) config.json."""
    status, heavy, err = command("hermes.cli", ["--model", inputs["model"], "--video", inputs["clip"], "--question",
                                                "q", "--chunk-frames", "2", "--device", "cpu"])
    assert status == 1 and {"torch", "transformers"} <= set(heavy), err
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and "Traceback" not in err


WITHOUT_TRANSFORMERS = textwrap.dedent("""
    import sys
    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "transformers":
                raise ImportError(f"{name} is not importable in this test")
    sys.meta_path.insert(0, Refuse())
    from hermes import cli  # the command line parses without it
    try:
        from hermes import HermesStream
    except ImportError as error:
        print("refused:", error)
    print("status", cli.main(sys.argv[1:]))
    import hermes_kernels  # the kernel library still imports
    print("kernels ok")
""")


def test_the_glue_says_to_install_the_model_extra_when_transformers_is_missing(inputs):
    """`from hermes import HermesStream` raises the ImportError that says what to install; a run whose arguments
    pass the checks prints it as its one error line (exit 1)."""
    argv = ["--model", inputs["model"], "--video", inputs["clip"], "--question", "q", "--quiet"]
    done = subprocess.run([sys.executable, "-c", WITHOUT_TRANSFORMERS, *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    needs = "hermes (the model glue, its commands and HermesStream) needs transformers: pip install " \
            "'hermes-kernels[model]'"
    assert f"refused: {needs}" in done.stdout
    assert "status 1" in done.stdout and done.stderr.startswith(f"error: {needs}")
    assert len(done.stderr.splitlines()) == 1
    assert "kernels ok" in done.stdout
