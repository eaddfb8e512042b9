"""The lmms-eval model plugin: `lmms-eval --model hermes --model_args pretrained=PATH,...` streams each request's
video through `HermesStream` under HERMES or H2SVC (docs/evaluation.md).

lmms-eval finds it through the `lmms_eval.models` entry point (`hermes.eval.manifest`); `hermes.eval.model` holds
the model class, `settings` its arguments, `requests` the order requests are served in, `feed` the video chunks.
Importing this package imports neither lmms-eval nor a model.
"""
