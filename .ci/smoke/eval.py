"""The `model` and `eval` extras with lmms-eval installed as docs/evaluation.md says: `lmms-eval --model hermes` on
a local multiple-choice task over two generated videos, offline (the test suite's task files, no pytest needed)."""
import tempfile

from scaffolding.checkpoint import save_tiny_checkpoint
from tests.hermes.eval.tasks import model_args, run_lmms_eval, write_tasks

with tempfile.TemporaryDirectory() as folder:
    paths = write_tasks(folder)
    checkpoint = save_tiny_checkpoint(f"{folder}/tiny", "qwen2_5_vl")
    done, samples = run_lmms_eval(folder, paths["include_path"], "hermes_mc", model_args(checkpoint, "hermes"))
    print(done.stdout[-2000:], done.stderr[-3000:])
    done.check_returncode()
    assert samples.get("hermes_mc"), f"no samples written: {sorted(samples)}"
print(f"model,eval extras: lmms-eval --model hermes answered {len(samples['hermes_mc'])} documents")
