"""Every call signature README.md and docs/ quote against the code's own (`inspect.signature`), so the pages cannot
drift from the functions they describe.

Two kinds of quote. A *declaration* is a line of a fenced block shaped as a signature, `hk.op(params) -> result`
(possibly over several lines): it must list every parameter of the real one, in order, of the same kind
(positional or keyword-only), with the same defaults. A *call* is an inline code span `name(args)`: each argument
written as a bare name (or `name=value`) must be a parameter, in the function's order, after a `*` only
keyword-only ones, and bare names before any `…` sit where the function has them; `…` stands for what the quote
leaves out. A name is looked up where the pages say it lives (`hk.` is `hermes_kernels`; `stream.` a
`HermesStream`; `cache.` a policy cache; bare names the public packages and the classes below); a call whose name
resolves nowhere is not checked, and the test counts what it checked so it cannot pass on nothing.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

import hermes
import hermes_kernels as hk
from hermes import models, policy
from hermes.cache import StreamCacheBase
from hermes.models.base import ModelFamily, VideoChunk
from hermes.policies.h2svc import head_map
from hermes.policies.h2svc.cache import H2SVCCache
from hermes.policies.h2svc.policy import H2SVCPolicy
from hermes.policies.hermes.cache import HermesCache
from hermes.policies.hermes.policy import HermesPolicy
from hermes.policy import StreamPolicy
from hermes.stream import HermesStream
from hermes_kernels import compat, rope
from hermes_kernels.engine import geometry
from hermes_kernels.policies.h2svc import reference as h2svc_reference
from hermes_kernels.policies.hermes import reference as hermes_reference
from hermes_kernels.rope import RotaryLayout
from scaffolding import census
from scaffolding import models as tiny_models
from tests.utils import REPO

PAGES = [Path(REPO) / "README.md", *sorted((Path(REPO) / "docs").glob("*.md"))]
# the objects a quote's qualifier stands for, as the pages use them; a quote under a package's or module's name
# must resolve (a name gone from it is a page to fix), any other may be a name of the pages' own
QUALIFIERS = {"hk": hk, "stream": HermesStream, "cache": StreamCacheBase, "family": ModelFamily,
              "policy": StreamPolicy}
PACKAGES = ("hk", "hermes_kernels", "hermes", "scaffolding")
# where a bare name is looked for, in this order (a quote passes when it fits any object of its name)
SCOPES = [hk, hermes, HermesStream, StreamCacheBase, HermesCache, H2SVCCache, StreamPolicy, HermesPolicy,
          H2SVCPolicy, ModelFamily, VideoChunk, policy, models, head_map, rope, geometry, geometry.ModelGeometry,
          RotaryLayout, hk.HermesConfig, hk.H2SVCConfig, hermes_reference, h2svc_reference, compat, census,
          tiny_models]
CALL = re.compile(r"`([A-Za-z_][A-Za-z0-9_.]*)\(([^`]*)\)`")
DECLARATION = re.compile(r"^(?:hk|hermes_kernels)\.([A-Za-z_][A-Za-z0-9_]*)\((.*?)\)\s*->", re.DOTALL | re.MULTILINE)
ELLIPSIS = ("...", "…")


def split_arguments(text: str) -> list[str]:
    """The top-level comma-separated items of an argument list (brackets and quotes nest)."""
    items, depth, quote, current = [], 0, None, ""
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(current.strip())
            current = ""
            continue
        current += ch
    if current.strip():
        items.append(current.strip())
    return items


def candidates(name: str) -> list:
    """The callables a quoted name may mean; ValueError for a package's or module's name that is not there."""
    *qualifier, last = name.split(".")
    if not qualifier:
        found = [getattr(scope, last, None) for scope in SCOPES]
        return [f for f in found if callable(f)]
    if qualifier[0] in QUALIFIERS:
        owner, rest = QUALIFIERS[qualifier[0]], qualifier[1:]
    elif qualifier[0] in PACKAGES:
        owner, rest = importlib.import_module(".".join(qualifier)), []
    else:
        owner = next((getattr(scope, qualifier[0]) for scope in SCOPES if hasattr(scope, qualifier[0])), None)
        rest = qualifier[1:]
    for part in rest:
        owner = getattr(owner, part, None)
    function = getattr(owner, last, None)
    if callable(function):
        return [function]
    if qualifier[0] in PACKAGES or qualifier[0] == "hk":
        raise ValueError(f"{name}: no such name")
    return []


def parameters(function) -> list[inspect.Parameter]:
    """Its parameters as a caller sees them (a class: its constructor's; a method looked up on its class: without
    self)."""
    params = list(inspect.signature(function).parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    return params


def call_fits(function, arguments: list[str]) -> str | None:
    """None when the quoted call fits the function's signature, else why not."""
    params = parameters(function)
    names = [p.name for p in params]
    variadic = any(p.kind is p.VAR_KEYWORD for p in params)
    keyword_only = False
    aligned = True  # no `…` and no `*` yet: a bare name sits where the function has that parameter
    last = -1
    for place, item in enumerate(arguments):
        if item in ELLIPSIS:
            aligned = False
            continue
        if item == "*":
            keyword_only, aligned = True, False
            continue
        if item.startswith("*"):
            wanted = inspect.Parameter.VAR_KEYWORD if item.startswith("**") else inspect.Parameter.VAR_POSITIONAL
            if not any(p.kind is wanted for p in params):
                return f"{item}: the function takes no {wanted.description} parameter"
            continue
        keyword = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)\s*=", item)
        name = keyword[1] if keyword else item if item.isidentifier() else None
        if name is None:
            continue  # a value in a place (a literal, an expression): its place is checked by count below
        if name not in names:
            if keyword and variadic:
                continue
            if not keyword and aligned and place < len(params) and params[place].kind in (
                    inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
                return f"{item}: the parameter in that place is {params[place].name!r}"
            return f"{item}: no such parameter (has {names})"
        index = names.index(name)
        if index < last:
            return f"{item}: out of order (the function has {names})"
        last = index
        kind = params[index].kind
        if keyword_only and kind is not inspect.Parameter.KEYWORD_ONLY:
            return f"{item}: quoted after * but not keyword-only"
        if not keyword and not keyword_only and kind is inspect.Parameter.KEYWORD_ONLY:
            return f"{item}: keyword-only, quoted as positional"
        if not keyword and aligned and index != place:
            return f"{item}: in place {place}, the function has it in place {index}"
    return None


def declaration_matches(function, text: str) -> str | None:
    """None when the quoted parameter list is the function's exactly (names, kinds, defaults)."""
    quoted, keyword_only = [], False
    for item in split_arguments(" ".join(text.split())):
        if item == "*":
            keyword_only = True
            continue
        name, _, default = item.partition("=")
        quoted.append((name.strip(), keyword_only, default.strip() or None))
    real = [(p.name, p.kind is p.KEYWORD_ONLY) for p in parameters(function)]
    if [q[:2] for q in quoted] != real:
        return f"quoted {[q[:2] for q in quoted]}, the function has {real}"
    for (name, _, default), param in zip(quoted, parameters(function)):
        if (default is None) != (param.default is param.empty):
            return f"{name}: quoted {'without' if default is None else 'with'} a default, the function the other way"
        if default is not None and ast.literal_eval(default) != param.default:
            return f"{name}: quoted default {default}, the function's is {param.default!r}"
    return None


def quotes() -> tuple[list, list]:
    """(declarations, calls): (page, name, argument text) of every quote on the pages."""
    declarations, calls = [], []
    for page in PAGES:
        text = page.read_text()
        blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.DOTALL)
        for block in blocks:
            declarations += [(page.name, m[1], m[2]) for m in DECLARATION.finditer(block)]
        prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
        calls += [(page.name, m[1], m[2]) for m in CALL.finditer(prose)]
    return declarations, calls


DECLARATIONS, CALLS = quotes()


@pytest.mark.parametrize("page,name,text", DECLARATIONS, ids=[f"{p}:{n}" for p, n, _ in DECLARATIONS])
def test_a_declared_signature_is_the_code_s(page, name, text):
    function = getattr(hk, name, None)
    assert callable(function), f"{page}: hk.{name} is not a public name of hermes_kernels"
    why = declaration_matches(function, text)
    assert why is None, f"{page}: hk.{name}({' '.join(text.split())}): {why}"


def test_every_quoted_call_fits_a_function_of_its_name():
    checked, wrong = 0, []
    for page, name, text in CALLS:
        try:
            found = candidates(name)
        except (ValueError, ImportError) as err:
            wrong.append(f"{page}: {name}({text}): {err}")
            continue
        if not found:
            continue
        checked += 1
        reasons = [call_fits(function, split_arguments(text)) for function in found]
        if all(reasons):
            wrong.append(f"{page}: {name}({text}): {reasons[0]}")
    assert not wrong, "\n".join(wrong)
    # the README's ops table and the pages' calls of the public API resolve: the check is not vacuous
    assert checked >= 100 and len(DECLARATIONS) >= 12, (checked, len(DECLARATIONS))


def test_the_checks_catch_what_they_are_for():
    """The two checks on quotes that are wrong in each way they look for."""
    assert call_fits(hk.stce_select, split_arguments("features, frames, arriving, first_frame, capacity"))
    assert call_fits(hk.h2svc_step, split_arguments("keys, …, *, held, num_frames"))
    assert call_fits(hk.compact, split_arguments("keys, values, positions, keep, cfg, inv_freq, *, rotary"))
    assert call_fits(hk.compact, split_arguments("values, keys")) is not None
    assert call_fits(hk.compact, split_arguments("keys, values, positions, keep, cfg, inv_freq")) is None
    assert declaration_matches(hk.hermes_scores, 'attn, cfg, *, backend="auto"')
    assert declaration_matches(hk.hermes_scores, 'attn, cfg, *, backend="torch", group=None')
    assert declaration_matches(hk.hermes_scores, 'attn, cfg, *, backend="auto", group=None') is None


def test_every_quoted_public_name_exists():
    """A name quoted under `hk.` (hermes_kernels' public names) is one of them: 0.2.0 took BACKENDS, resolve_backend
    and launch_count out, and a page that still says `hk.launch_count()` sends a reader to an AttributeError."""
    missing = []
    for page in PAGES:
        for name in sorted(set(re.findall(r"\bhk\.([A-Za-z_][A-Za-z0-9_]*)", page.read_text()))):
            if name not in hk.__all__:
                missing.append(f"{page.name}: hk.{name}")
    assert not missing, missing
