import re
from pathlib import Path

from setuptools import find_packages, setup

# the one version: hermes_kernels/version.py (read as text: importing the package needs torch)
VERSION = re.search(r'__version__ = "([^"]+)"', (Path(__file__).parent / "hermes_kernels/version.py").read_text())[1]

setup(
    name="hermes-kernels",
    version=VERSION,
    description="Fused Triton kernels and a transformers cache for HERMES streaming-video KV-cache compression",
    # the kernel library and the model glue; bench/ and tests/ run from the checkout and are not installed. The kernel
    # library (hermes_kernels, hermes_kernels.compat included) needs torch and triton only, so it installs into the
    # released HERMES code's environment beside whatever transformers that pins; the glue (hermes) needs "model".
    packages=find_packages(include=["hermes", "hermes.*", "hermes_kernels", "hermes_kernels.*"]),
    package_data={"hermes_kernels": ["*.c"]},  # compiled on first use by hermes_kernels.native
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4,<2.15",
        # the version the tests, the order-shuffled interpreter mode and the compile guard run with: widen the
        # bound once they pass on another (docs/gpu.md#triton-versions)
        "triton>=3.9,<3.10",
    ],
    # the commands (docs/cli.md); `python -m hermes` and `python -m hermes.policies.h2svc.profile` run the same
    entry_points={"console_scripts": ["hermes = hermes.cli:main",
                                      "hermes-profile = hermes.policies.h2svc.profile:main"]},
    extras_require={
        "model": ["transformers>=5.0,<6"],  # the model glue, hermes (HermesStream, the caches, the commands)
        # av: the tests write and decode .mp4 files (python -m hermes needs it too, see "video")
        "test": ["pytest>=8", "pytest-benchmark>=4", "hypothesis>=6", "av>=12"],
        "bench": ["matplotlib>=3.7", "tqdm>=4.60"],  # python -m bench; its end-to-end rows also need "model"
        "video": ["av>=12", "tqdm>=4.60"],  # python -m hermes: PyAV decodes, tqdm shows progress
        "flash": ["flash-attn>=2.6"],
        "dev": ["ruff>=0.6", "mkdocs>=1.6,<2", "mkdocs-material>=9.5"],  # .ci/run: lint and the docs site
    },
)
