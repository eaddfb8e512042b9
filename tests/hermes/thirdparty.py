"""Third-party policy packages for the registry's tests: a package and its `NAME-0.1.dist-info` folder (METADATA,
entry_points.txt) written under a folder which the test then puts on sys.path or PYTHONPATH, where importlib.metadata
finds it as an installed distribution. Nothing in hermes imports them: they are found through the `hermes.policies`
entry points only (docs/policies.md#registry).

`write_fifo(folder)`: the package `thirdparty_fifo`, whose entry point `fifo = thirdparty_fifo` makes the FIFO test
policy (tests/hermes/stream/fifo_policy.py, registered as "fifo" when imported) an installed one.
"""
from __future__ import annotations

import os

from hermes.registry import ENTRY_POINT_GROUP

FIFO_PACKAGE = "thirdparty_fifo"
FIFO_SOURCE = '''"""The FIFO test policy, as an installed package would hold a policy of its own."""
from tests.hermes.stream.fifo_policy import FifoPolicy  # noqa: F401 (importing it registers "fifo")
'''


def write_distribution(folder, package: str, entry_points: dict[str, str], source: str) -> str:
    """`folder`/`package`/__init__.py holding `source`, and `folder`/`package`-0.1.dist-info declaring
    `entry_points` (name -> "module" or "module:Class") in the group hermes.policies. Returns `folder`."""
    os.makedirs(os.path.join(folder, package))
    with open(os.path.join(folder, package, "__init__.py"), "w") as f:
        f.write(source)
    info = os.path.join(folder, f"{package}-0.1.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write(f"[{ENTRY_POINT_GROUP}]\n" + "".join(f"{name} = {value}\n" for name, value in entry_points.items()))
    return os.fspath(folder)


def write_fifo(folder) -> str:
    """thirdparty_fifo under `folder` (returned): `hermes --policy fifo` with `folder` on PYTHONPATH."""
    return write_distribution(folder, FIFO_PACKAGE, {"fifo": FIFO_PACKAGE}, FIFO_SOURCE)
