import re
from pathlib import Path

from setuptools import find_packages, setup

# the one version: hermes_kernels/version.py (read as text: importing the package needs torch)
VERSION = re.search(r'__version__ = "([^"]+)"', (Path(__file__).parent / "hermes_kernels/version.py").read_text())[1]

setup(
    name="hermes-kernels",
    version=VERSION,
    description="Fused Triton kernels and a transformers cache for HERMES streaming-video KV-cache compression",
    # the kernel library and the model glue; bench/, tests/ and scaffolding/ (tiny models, the released-class
    # stand-in) run from the checkout and are not installed (tests/test_packaging.py). The kernel library
    # (hermes_kernels, hermes_kernels.compat included) needs torch and triton only, so it installs into the released
    # HERMES code's environment beside whatever transformers that pins; the glue (hermes) needs "model".
    packages=find_packages(include=["hermes", "hermes.*", "hermes_kernels", "hermes_kernels.*"],
                           exclude=["scaffolding", "scaffolding.*", "tests", "tests.*", "bench", "bench.*"]),
    package_data={"hermes_kernels.engine": ["*.c"]},  # compiled on first use by hermes_kernels.engine.native
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4,<2.15",
        # the version the tests, the order-shuffled interpreter mode and the compile guard run with: widen the
        # bound once they pass on another (docs/gpu.md#triton-versions)
        "triton>=3.9,<3.10",
    ],
    # the commands (docs/cli.md); `python -m hermes` and `python -m hermes.profile_cli` run the same
    entry_points={"console_scripts": ["hermes = hermes.cli:main",
                                      "hermes-profile = hermes.profile_cli:main"],
                  # lmms-eval --model hermes (docs/evaluation.md): its registry reads this group when it starts
                  "lmms_eval.models": ["hermes = hermes.eval.manifest:manifest"]},
    extras_require={
        # the model glue, hermes (HermesStream, the caches, the commands); transformers: the releases the suite
        # passes on, oldest to the next minor after the newest (docs/install.md#ranges: how to try another);
        # accelerate: transformers asks for it to load a model with tensor parallelism (DistributedConfig(tp_size=N),
        # docs/multi-gpu.md); pillow: the families' image processors (transformers' own "vision" floor)
        "model": ["transformers>=5.24,<5.26", "accelerate>=1.0,<2", "pillow>=10.0.1"],
        # av: the tests write and decode .mp4 files (python -m hermes needs it too, see "video")
        "test": ["pytest>=8", "pytest-benchmark>=4", "hypothesis>=6", "av>=17"],
        "bench": ["matplotlib>=3.7", "tqdm>=4.60"],  # python -m bench; its end-to-end rows also need "model"
        "video": ["av>=17", "tqdm>=4.60"],  # python -m hermes: PyAV decodes, tqdm shows progress
        "flash": ["flash-attn>=2.6"],
        # lmms-eval's own import and command line (docs/evaluation.md#install); lmms-eval itself installs with
        # --no-deps beside it (pip install --no-deps lmms-eval==0.7.3), since its torchvision requirement would
        # replace the pinned CPU torch; filelock < 4: lmms-eval 0.7.3 patches filelock._api, gone in 4.x
        "eval": ["accelerate>=1.0,<2", "datasets>=3.0,<6", "evaluate>=0.4,<0.5", "filelock>=3.16,<4",
                 "loguru>=0.7,<0.8", "pytablewriter>=1.2,<2", "pytz", "sacrebleu>=2.4,<3", "tenacity>=8.3",
                 "av>=17", "tqdm>=4.60"],
        "dev": ["ruff>=0.6", "mkdocs>=1.6,<2", "mkdocs-material>=9.5"],  # .ci/run: lint and the docs site
    },
)
