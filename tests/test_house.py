"""The house's own rules, as a newcomer would check them: the configuration loads no prober, no
module is too long to read, nothing is imported by a string the layer checker cannot see, no
transport is branched on outside its own package, and the docs' code map names files that exist.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.engines import ENGINES
from sidecar.transports import TRANSPORTS

ROOT = Path(__file__).resolve().parents[1]
SIDECAR = ROOT / "sidecar"
MAX_LINES = 600
MAX_CONFIG_MODULES = 15


def _modules() -> list[Path]:
    return sorted(SIDECAR.rglob("*.py"))


@pytest.mark.process
def test_importing_the_configuration_loads_no_prober() -> None:
    """A fresh interpreter: ``import sidecar.config`` loads at most 15 sidecar modules, and
    none of the engines, probes or transports."""
    code = (
        "import json, sys; import sidecar.config; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('sidecar'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    loaded = json.loads(out)
    assert len(loaded) <= MAX_CONFIG_MODULES, loaded
    assert not [m for m in loaded if m.split(".")[1:2] in (["probes"], ["engines"], ["transports"])]


@pytest.mark.unit
def test_no_module_is_too_long_to_read() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in _modules()
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


@pytest.mark.unit
def test_nothing_is_imported_by_a_string() -> None:
    """Every import is a statement the layer checker sees: no importlib.import_module, no
    __import__ (a module looked up without loading it, find_spec, is fine)."""
    found = []
    for path in _modules():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                if name.endswith("import_module") or name == "__import__":
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    assert not found, found


# A transport's or backend's name compared with, matched on or looked up by a literal: the shapes
# of a branch on which one it is.
_NAMES = {*TRANSPORTS, *(e for e in ENGINES)}


def _branches(tree: ast.AST) -> list[tuple[int, str]]:
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            names = [ast.unparse(s) for s in sides]
            literals = {
                s.value for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)
            }
            if literals & set(TRANSPORTS) and any("transport" in n for n in names):
                hits.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.match_case):
            pattern = ast.unparse(node.pattern)
            if any(f"'{name}'" in pattern for name in TRANSPORTS):
                hits.append((node.lineno, f"case {pattern}"))
    return hits


@pytest.mark.unit
def test_no_transport_is_branched_on_outside_its_package() -> None:
    """The tools, the surface, the core, the engines, the probes, the runtime and the wiring never
    ask which transport it is (a transport's own behaviour is its package's); the configuration
    only where a URL's scheme is read (at most 3)."""
    outside: dict[str, list[tuple[int, str]]] = {}
    config = 0
    for path in _modules():
        rel = path.relative_to(SIDECAR)
        if rel.parts[0] == "transports":
            continue
        hits = _branches(ast.parse(path.read_text(encoding="utf-8")))
        if rel.parts[0] == "config":
            config += len(hits)
        elif hits:
            outside[str(rel)] = hits
    assert not outside, outside
    assert config <= 3


_PATH = re.compile(r"`((?:sidecar|fakeengine|tests|scripts|bench|deploy|config)/[A-Za-z0-9_./-]+)`")


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.unit
def test_every_path_the_docs_name_exists() -> None:
    """The code map, and every page that names a file or folder of the checkout, name what is
    there (a path with a placeholder, ``<backend>``, is a pattern and not checked)."""
    missing = []
    for doc in _documents():
        for match in _PATH.finditer(doc.read_text(encoding="utf-8")):
            path = match.group(1).rstrip(".")
            if not (ROOT / path).exists():
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not missing, missing


@pytest.mark.unit
def test_the_docs_name_every_transports_package_and_every_engine() -> None:
    """The transports' table (generated from TRANSPORTS) names each one's package, and the
    engines' table (generated from ENGINES) each one's module, which hold them."""
    table = (ROOT / "docs/concepts/transports.md").read_text(encoding="utf-8")
    for name, transport in TRANSPORTS.items():
        package = "sidecar/transports/" + type(transport).__module__.rpartition(".")[2] + "/"
        assert (ROOT / package / "__init__.py").is_file(), name
        assert f"`{package}`" in table, name
    engines = (ROOT / "docs/concepts/backends.md").read_text(encoding="utf-8")
    for name, engine in ENGINES.items():
        module = "sidecar/engines/" + type(engine).__module__.rpartition(".")[2] + ".py"
        assert (ROOT / module).is_file(), name
        assert f"`{module}`" in engines, name
