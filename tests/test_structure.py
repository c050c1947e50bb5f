"""The structure of the tree: imports point one way (layouts <- custom_calls <- moe_jax), and inside
custom_calls by the levels of its units (CUSTOM_CALLS_LEVELS); no module imports another that
imports it back (at module level or inside a function), and the sources cite only what the
repository holds."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("layouts", "custom_calls", "moe_jax")
LAYER = {"layouts": 0, "custom_calls": 1, "moe_jax": 2}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _sources():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            yield _module_name(path), path


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """Internal modules `name` imports anywhere in its source (module level or in functions)."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                prefix = base[: len(base) - node.level + 1]
                mod = ".".join(prefix + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            mods = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        found.update(m for m in mods if m.split(".")[0] in PACKAGES)
    return found


MODULES = dict(_sources())


def _resolve(mod: str) -> str | None:
    """The module a dotted import names (a submodule, or the module an attribute lives in)."""
    while mod and mod not in MODULES:
        mod = mod.rpartition(".")[0]
    return mod or None


GRAPH = {name: {m for m in map(_resolve, _imports(name, path)) if m and m != name}
         for name, path in MODULES.items()}


def test_imports_point_one_way():
    bad = [(a, b) for a, deps in GRAPH.items() for b in deps
           if LAYER[b.split(".")[0]] > LAYER[a.split(".")[0]]]
    assert not bad, f"imports against the layering layouts <- custom_calls <- moe_jax: {bad}"


def test_no_two_modules_import_each_other():
    # a package's __init__ re-exporting its own submodules is not a cycle of logic
    pairs = [(a, b) for a, deps in GRAPH.items() for b in deps
             if a in GRAPH.get(b, ()) and a < b and not (a.startswith(b + ".") or b.startswith(a + "."))]
    assert not pairs, f"modules importing each other: {pairs}"


# Inside custom_calls, each module belongs to a unit: its subpackage (native, deep_gemm, triton, cuda),
# a composition module, or "core" (every other plain module: the registry, the op declarations and
# their references, the contracts). A unit imports only units of a lower level: the native launcher
# imports no other custom_calls module; core may not import a kernel family (the families load
# lazily, through the registry); the kernel families share a level, so none imports another; the
# compositions are above them: the fused ops' SM90 composition (Triton kernels around the DeepGEMM
# fused kernel) and the W4A8 backend (the CUDA kernels on a GPU, the Triton kernels under the interpreter).
# settings (read by everything) < native launcher < ops and registry < kernel families < their composition
CUSTOM_CALLS_LEVELS = {"settings": 0, "native": 1, "core": 2, "deep_gemm": 3, "triton": 3, "cuda": 3,
                       "fused_moe_sm90": 4, "w4a8_backend": 4}
FAMILIES = ("custom_calls.deep_gemm", "custom_calls.triton", "custom_calls.cuda")


def _unit(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in CUSTOM_CALLS_LEVELS else "core"


def _in(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def test_every_custom_calls_subpackage_has_a_level():
    subpackages = {p.parent.name for p in (ROOT / "custom_calls").glob("*/__init__.py")}
    assert subpackages <= set(CUSTOM_CALLS_LEVELS), subpackages - set(CUSTOM_CALLS_LEVELS)
    assert all(f"custom_calls.{u}" in MODULES for u in CUSTOM_CALLS_LEVELS if u != "core")


def test_the_kernel_families_do_not_import_each_other():
    bad = [(a, b) for a, deps in GRAPH.items() for b in deps
           if any(_in(a, f) and _in(b, g) for f in FAMILIES for g in FAMILIES if f != g)]
    assert not bad, f"imports between the kernel families: {bad}"


def test_custom_calls_units_import_only_lower_levels():
    bad = [(a, b) for a, deps in GRAPH.items() if _in(a, "custom_calls") for b in deps
           if _in(b, "custom_calls") and _unit(a) != _unit(b)
           and CUSTOM_CALLS_LEVELS[_unit(b)] >= CUSTOM_CALLS_LEVELS[_unit(a)]]
    assert not bad, f"imports against the levels {CUSTOM_CALLS_LEVELS} of custom_calls: {bad}"


def test_the_graph_is_real():
    # the checks above would pass vacuously if the parser found nothing
    assert "layouts.gemm_format" in GRAPH["layouts.recipes"]
    assert "custom_calls.backends" in GRAPH["custom_calls.grouped_gemm"]
    assert "moe_jax.params" in GRAPH["moe_jax.layer"]
    assert "custom_calls.native.launch" in GRAPH["custom_calls.deep_gemm.ops"]
    assert "custom_calls.native.launch_plan" in GRAPH["custom_calls.triton.native"]
    assert "custom_calls.triton.router_kernel" in GRAPH["custom_calls.fused_moe_sm90"]  # inside a function


@pytest.mark.parametrize("pattern", [r"SPEC\s*§", r"\bseed(?:'s)?\s*§", r"\bSPEC\.md\b", r"\bDESIGN\.md\b"])
def test_sources_cite_no_outside_document(pattern):
    files = [p for _, p in _sources()] + sorted(ROOT.glob("*.md")) + sorted(ROOT.rglob("docs/*.md"))
    files += sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.md"))
    hits = [f"{p.relative_to(ROOT)}:{i + 1}" for p in files
            for i, line in enumerate(p.read_text().splitlines()) if re.search(pattern, line)]
    assert not hits, f"citations of a document outside the repository: {hits}"
