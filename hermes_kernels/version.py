"""The package version, in one place: `hermes_kernels.__version__` and setup.py read it (CHANGELOG.md says what
changed)."""
__version__ = "0.2.0"
