"""Test and benchmark support that runs from a checkout and is not installed: setup.py leaves this package out of
the wheel, and nothing in `hermes_kernels` or `hermes` imports it (tests/test_packaging.py checks both).

scaffolding/standin/: a stand-in of the released HERMES classes (the adapter's test oracle, the benchmark's
released-style baseline), without transformers. scaffolding/tokenizer.py, models.py, pixels.py, processors.py,
checkpoint.py: tiny random LLaVA-OV / Qwen2.5-VL / Qwen3-VL models, their word-level tokenizer, pixel inputs and
saved checkpoints (`python -m scaffolding.checkpoint OUT --model-type qwen2_5_vl`: a dry run of the `hermes`
command). scaffolding/census.py: the live-tensor census. scaffolding/rotary.py: proportional RoPE's inv_freq
(Gemma 4). See docs/testing.md#scaffolding.
"""
