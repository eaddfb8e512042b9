"""The policy registry's outcomes, one test each (docs/policies.md#registry): the same class registered again, a
clashing name (a built-in one too, before its module was first imported), something that is not a policy class,
an unknown name; an installed package's policy (entry points of the group hermes.policies) listed without being
imported, loaded on its first lookup, and a broken one failing its own lookup only. A refused registration leaves
the registry as it was."""
import importlib
import sys

import pytest

import hermes.registry as registry
from hermes.policy import StreamPolicy
from hermes.registry import check_policy_name, get_policy, policy_names, register_policy
from tests.hermes.thirdparty import write_distribution


@pytest.fixture
def fresh(monkeypatch):
    """The registry as it is (the built-in policies imported), restored after the test; so are the built-in modules
    in sys.modules and on their packages, which a test importing them again replaces."""
    for name, module_name in registry._BUILT_IN.items():
        get_policy(name)
        module = sys.modules[module_name]
        package, _, attribute = module_name.rpartition(".")
        monkeypatch.setitem(sys.modules, module_name, module)
        monkeypatch.setattr(sys.modules[package], attribute, module)
    monkeypatch.setattr(registry, "_REGISTERED", dict(registry._REGISTERED))
    return registry._REGISTERED


def _policy(name: str) -> type[StreamPolicy]:
    return type("Policy_" + name.replace("-", "_"), (StreamPolicy,), {"name": name})


def test_registering_the_same_class_again_changes_nothing(fresh):
    first = _policy("twice")
    assert register_policy(first) is first
    before = dict(fresh)
    assert register_policy(first) is first
    assert fresh == before and get_policy("twice") is first and policy_names().count("twice") == 1


def test_a_clashing_name_is_refused_and_the_first_class_kept(fresh):
    first, second = _policy("clash"), _policy("clash")
    register_policy(first)
    before = dict(fresh)
    with pytest.raises(ValueError, match="policy: the name 'clash' is taken by Policy_clash"):
        register_policy(second)
    assert fresh == before and get_policy("clash") is first


def test_a_built_in_name_is_taken_before_its_module_is_imported(fresh, monkeypatch):
    """A class named like a built-in policy, registered while that policy's module has not been imported yet: refused
    (the built-in is imported to be checked against), and the name still gives the built-in."""
    for name in ("hermes", "h2svc"):
        fresh.pop(name, None)
        monkeypatch.delitem(sys.modules, registry._BUILT_IN[name])  # as if never imported
        with pytest.raises(ValueError, match=f"policy: the name '{name}' is taken by"):
            register_policy(_policy(name))
        built_in = get_policy(name)
        assert built_in.__module__ == registry._BUILT_IN[name] and fresh[name] is built_in


@pytest.mark.parametrize("thing", [object, int, "hermes", None, StreamPolicy, _policy("an-instance")],
                         ids=["object", "int", "a-string", "None", "the-base", "an-instance"])
def test_something_that_is_not_a_policy_class_is_refused(thing, fresh):
    before = dict(fresh)
    if thing is StreamPolicy:  # the base itself is a policy class without a name
        with pytest.raises(ValueError, match="StreamPolicy needs a class attribute `name`"):
            register_policy(thing)
    else:
        thing = object.__new__(thing) if isinstance(thing, type) and issubclass(thing, StreamPolicy) else thing
        with pytest.raises(TypeError, match="policy: expected a StreamPolicy subclass, got"):
            register_policy(thing)
    assert fresh == before


def test_an_unknown_name_lists_the_known_ones(fresh):
    register_policy(_policy("listed"))
    with pytest.raises(ValueError, match=r"policy: expected one of \[.*'h2svc', 'hermes', .*'listed'.*\], got 'nope'"):
        get_policy("nope")
    assert set(policy_names()) >= {"h2svc", "hermes", "listed"} and "nope" not in fresh


def test_a_built_in_policy_is_imported_on_its_first_lookup(fresh, monkeypatch):
    """Nothing imports the built-in policies' modules but the first lookup of their name."""
    for name in ("hermes", "h2svc"):
        fresh.pop(name, None)
        monkeypatch.delitem(sys.modules, registry._BUILT_IN[name])  # as if never imported
        built_in = get_policy(name)
        assert built_in.name == name and built_in.__module__ == registry._BUILT_IN[name] and fresh[name] is built_in
        assert registry._BUILT_IN[name] in sys.modules


@pytest.mark.parametrize("name", ["", 5, None], ids=["empty", "an-int", "None"])
def test_a_policy_class_without_a_usable_name_is_refused(name, fresh):
    before = dict(fresh)
    with pytest.raises(ValueError, match="needs a class attribute `name` \\(a non-empty string\\)"):
        register_policy(type("Unnamed", (StreamPolicy,), {"name": name}))
    assert fresh == before


# ---- installed packages' policies (entry points) ------------------------------------------------------------------
DECORATED = """from hermes.policy import StreamPolicy
from hermes.registry import register_policy


@register_policy
class Policy(StreamPolicy):
    name = "{name}"
"""
UNDECORATED = """from hermes.policy import StreamPolicy


class Policy(StreamPolicy):
    name = "{name}"
"""


@pytest.fixture
def install(fresh, tmp_path, monkeypatch):
    """install(package, entry_points, source): a third-party distribution on sys.path (`write_distribution`), found
    by importlib.metadata from then on; its module is forgotten afterwards, and the registry restored (`fresh`)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    packages = []

    def installer(package: str, entry_points: dict[str, str], source: str) -> None:
        write_distribution(tmp_path, package, entry_points, source)
        importlib.invalidate_caches()  # importlib.metadata caches what a path holds
        packages.append(package)

    yield installer
    for package in packages:
        sys.modules.pop(package, None)


def test_an_installed_policy_is_listed_and_checked_without_being_imported(install):
    install("listed_policy", {"listed-3p": "listed_policy"}, DECORATED.format(name="listed-3p"))
    assert "listed-3p" in policy_names() and check_policy_name("listed-3p") == "listed-3p"
    assert "listed_policy" not in sys.modules and "listed-3p" not in registry._REGISTERED


@pytest.mark.parametrize("value,source", [("module_policy", DECORATED), ("module_policy:Policy", UNDECORATED)],
                         ids=["module-registers", "module:Class"])
def test_an_installed_policy_is_loaded_on_its_first_lookup(value, source, install):
    """`NAME = module` (the module registers its class on import) or `NAME = module:Class` (the class is registered
    on loading): the first lookup of NAME imports the module and gives its class; the next gives the same class."""
    install("module_policy", {"installed-3p": value}, source.format(name="installed-3p"))
    policy = get_policy("installed-3p")
    assert policy.__module__ == "module_policy" and policy.name == "installed-3p"
    assert get_policy("installed-3p") is policy is registry._REGISTERED["installed-3p"]


@pytest.mark.parametrize("source,reason", [
    ("raise RuntimeError('half installed')\n", "failed to load: RuntimeError: half installed"),
    ('"""Registers nothing."""\n', "registered no policy named 'broken-3p'"),
    (DECORATED.format(name="another-name"), "registered no policy named 'broken-3p'"),
], ids=["raises", "registers-nothing", "registers-another-name"])
def test_a_broken_installed_policy_fails_its_own_lookup_only(source, reason, install):
    """One ImportError naming the entry point and its distribution, on the lookup of its name; the other names are
    listed, checked and found as before."""
    install("broken_policy", {"broken-3p": "broken_policy"}, source)
    assert {"broken-3p", "h2svc", "hermes"} <= set(policy_names()) and get_policy("hermes").name == "hermes"
    with pytest.raises(ImportError) as info:
        get_policy("broken-3p")
    assert str(info.value) == (f"policy: entry point broken-3p = broken_policy (group hermes.policies) of the "
                               f"distribution broken_policy 0.1 {reason}")
    with pytest.raises(ValueError, match=r"policy: expected one of \[.*'broken-3p'.*\], got 'nope'"):
        get_policy("nope")


def test_a_name_two_packages_declare_is_the_first_one_s_on_sys_path(fresh, tmp_path, monkeypatch):
    """As imports do: the distribution found first on sys.path gives the policy; the other is never imported."""
    for rank in ("second", "first"):  # each prepended: "first" ends up first
        monkeypatch.syspath_prepend(write_distribution(tmp_path / rank, f"twin_{rank}", {"twin-3p": f"twin_{rank}"},
                                                       DECORATED.format(name="twin-3p")))
    try:
        assert get_policy("twin-3p").__module__ == "twin_first" and "twin_second" not in sys.modules
    finally:
        for rank in ("second", "first"):
            sys.modules.pop(f"twin_{rank}", None)
