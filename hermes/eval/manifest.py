"""The `lmms_eval.models` entry point (setup.py): lmms-eval's model registry loads `manifest` when it starts and
then resolves `--model hermes` to `hermes.eval.model.HermesModel` (docs/evaluation.md#install)."""
from lmms_eval.models.registry_v2 import ModelManifest

manifest = ModelManifest(model_id="hermes", simple_class_path="hermes.eval.model.HermesModel")
