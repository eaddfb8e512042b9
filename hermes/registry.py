"""The policy registry: the names a `HermesStream` can be built with and the `hermes.policy.StreamPolicy` class
behind each (docs/policies.md#registry).

A name comes from one of three places, none imported before its name is looked up:
- the built-in policies, "hermes" and "h2svc", imported on first lookup;
- classes registered in this process (`register_policy`);
- installed packages' entry points of the group `hermes.policies` (`NAME = module` or `NAME = module:Class`), loaded
  on the first lookup of their name.
So listing and checking names (`policy_names`, `check_policy_name`) imports no policy, nor torch or transformers:
the commands refuse an unknown --policy before anything heavy loads, and a broken third-party package fails only
the commands that ask for its policy.
"""
from __future__ import annotations

import importlib
from importlib import metadata
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hermes.policy import StreamPolicy

ENTRY_POINT_GROUP = "hermes.policies"  # where installed packages declare their policies (docs/policies.md#registry)
# the built-in policies: name -> the module that registers it (imported on first lookup)
_BUILT_IN = {"hermes": "hermes.policies.hermes.policy", "h2svc": "hermes.policies.h2svc.policy"}
_REGISTERED: dict[str, type[StreamPolicy]] = {}


def register_policy(cls: type[StreamPolicy]) -> type[StreamPolicy]:
    """Register a `StreamPolicy` subclass under its `name` (usable as a class decorator); the same class again changes
    nothing, a name taken by another class is refused (a built-in name too, before its module was ever imported), and
    so is anything but a named policy class."""
    from hermes.policy import StreamPolicy  # imported already wherever a policy class was defined

    if not (isinstance(cls, type) and issubclass(cls, StreamPolicy)):
        raise TypeError(f"policy: expected a StreamPolicy subclass, got {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"policy: {cls.__name__} needs a class attribute `name` (a non-empty string)")
    if name in _BUILT_IN and name not in _REGISTERED and cls.__module__ != _BUILT_IN[name]:
        importlib.import_module(_BUILT_IN[name])  # registers the built-in, which then holds the name
    if _REGISTERED.get(name, cls) is not cls:
        raise ValueError(f"policy: the name {name!r} is taken by {_REGISTERED[name].__name__}")
    _REGISTERED[name] = cls
    return cls


def policy_names() -> list[str]:
    """The names a stream can be built with, sorted: the built-in policies, every registered one and every installed
    entry point's (none of them imported)."""
    return sorted(set(_BUILT_IN) | set(_REGISTERED) | set(_installed()))


def check_policy_name(name) -> str:
    """`name` when a stream can be built with it, found without importing any policy; ValueError naming `policy` and
    listing the known names otherwise."""
    if not (isinstance(name, str) and (name in _BUILT_IN or name in _REGISTERED or name in _installed())):
        raise ValueError(f"policy: expected one of {policy_names()}, got {name!r}")
    return name


def get_policy(name: str) -> type[StreamPolicy]:
    """The policy class registered as `name`: a built-in one is imported, an installed entry point loaded on first
    lookup. ValueError naming `policy` for an unknown name; ImportError naming the entry point and its distribution
    for one that fails to load or registers no policy of its name."""
    check_policy_name(name)
    if name not in _REGISTERED and name in _BUILT_IN:
        importlib.import_module(_BUILT_IN[name])
    if name not in _REGISTERED:
        _load(_installed()[name])
    return _REGISTERED[name]


def _installed() -> dict[str, metadata.EntryPoint]:
    """name -> entry point of `ENTRY_POINT_GROUP` in the installed distributions' metadata, imported by nobody; read
    on every call, so a package installed or a path added since is seen."""
    points: dict[str, metadata.EntryPoint] = {}
    for point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        points.setdefault(point.name, point)  # two packages declaring one name: the first on sys.path, as imports do
    return points


def _load(point: metadata.EntryPoint) -> None:
    """Import an entry point's module (which registers its policy), registering the class it names (`module:Class`);
    ImportError naming the entry point and its distribution when that fails or leaves its name unregistered."""
    where = (f"entry point {point.name} = {point.value} (group {ENTRY_POINT_GROUP}) of the distribution "
             f"{point.dist.name} {point.dist.version}")
    try:
        loaded = point.load()
        if isinstance(loaded, type):
            register_policy(loaded)
    except Exception as err:  # noqa: BLE001 (a third-party module fails any way it likes: name the package to fix)
        raise ImportError(f"policy: {where} failed to load: {type(err).__name__}: {err}") from err
    if point.name not in _REGISTERED:
        raise ImportError(f"policy: {where} registered no policy named {point.name!r}")
