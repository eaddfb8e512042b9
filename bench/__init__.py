"""Per-chunk compression latency benchmarks (the project's main job): `python -m bench`, see bench/cli.py."""
