"""The policy registry's outcomes, one test each (docs/policies.md#registry): the same class registered again, a
clashing name (a built-in one too, before its module was first imported), something that is not a policy class,
an unknown name. A refused registration leaves the registry as it was."""
import sys

import pytest

import hermes.policy as registry
from hermes.policy import StreamPolicy, get_policy, policy_names, register_policy


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
