"""The docs cannot drift from the code.

- The generated parts (the configuration table, the timings, the decision tables, the CLI output)
  are what ``scripts/gen_docs.py`` makes of the code now, and the check catches a change.
- Every row of the generated decision tables holds for the real functions.
- The metrics table names exactly the series the sidecar exports.
- Every path and relative link in README.md and docs/ exists; defaults quoted in prose are the
  defaults; the README stays short.
"""

from __future__ import annotations

import copy
import importlib.util
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

from sidecar.config import Settings
from sidecar.core import verdict
from sidecar.core.endpoint import (
    EndpointState,
    apply_canary,
    apply_discovery,
    apply_faults,
    apply_lifecycle,
    apply_registration,
)
from sidecar.core.evidence import lifecycle
from sidecar.core.evidence.faults import EngineReport
from sidecar.core.evidence.policy import Policy, Sum, Term
from sidecar.core.evidence.result import Outcome, Result
from sidecar.core.verdict import Verdict, endpoint_verdict, rank_verdict
from tests.support.configured import settings_from

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gen_docs.py"
README = ROOT / "README.md"
README_MAX_LINES = 220
# Where the repository's paths start, as the docs mention them.
TOP = ("sidecar", "fakeengine", "deploy", "config", "scripts", "docs", "bench", "tests")
PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(TOP)})/[^\s`'\"()\[\]|,;:]*)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def load_gen_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_docs", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen_docs() -> ModuleType:
    return load_gen_docs()


def documents() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def written_docs() -> list[Path]:
    """README.md and the docs by reader (docs/*/); the measurement documents at docs/*.md
    describe particular runs and are left out of the checks on prose."""
    return [README, ROOT / "docs" / "README.md", *sorted((ROOT / "docs").glob("*/*.md"))]


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --- (a) generated parts -----------------------------------------------------------------------
@pytest.mark.process
def test_the_generated_parts_are_what_the_code_says_now():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, (
        f"{done.stdout}{done.stderr}\nrun: .venv/bin/python scripts/gen_docs.py"
    )


@pytest.mark.unit
def test_every_generator_has_a_place_and_every_place_a_generator(gen_docs):
    names = set()
    for path in documents():
        names |= {m.group("name") for m in gen_docs.MARKER.finditer(path.read_text("utf-8"))}
    assert names == set(gen_docs.GENERATORS)


# --- (e) drift is caught -----------------------------------------------------------------------
@pytest.mark.unit
def test_a_changed_default_is_caught(gen_docs):
    fields = dict(Settings.model_fields)
    changed = copy.copy(fields["canary_wait_time"])
    changed.default = 11.0
    fields["canary_wait_time"] = changed
    generators = dict(gen_docs.GENERATORS, settings=lambda: gen_docs.settings_table(fields))

    drifted = gen_docs.drift(ROOT, generators)

    page = ROOT / "docs" / "reference" / "configuration.md"
    assert set(drifted) == {page}
    lines = gen_docs.diff(page, *drifted[page]).splitlines()
    assert any(line.startswith("-| `DYN_CANARY_WAIT_TIME`") and "`10`" in line for line in lines)
    assert any(line.startswith("+| `DYN_CANARY_WAIT_TIME`") and "`11`" in line for line in lines)


@pytest.mark.unit
def test_a_changed_formula_is_caught(gen_docs):
    class Changed(Policy):
        def to_stalled(self) -> Sum:
            """From counters stopping under load to notready ("stalled"), at the longest."""
            return Sum((Term(self.suspect_after, "quiet"), Term(self.timeout, "timeout")))

    generators = dict(gen_docs.GENERATORS, policy=lambda: gen_docs.policy_section(Changed))

    drifted = gen_docs.drift(ROOT, generators)

    page = ROOT / "docs" / "concepts" / "decision-model.md"
    assert set(drifted) == {page}
    text = gen_docs.diff(page, *drifted[page])
    assert (
        "-| `to_stalled()` | 0.65 s busy metrics interval + 1.35 s quiet + 3 s timeout = 5 s |"
        in text
    )
    assert "+| `to_stalled()` | 1.35 s quiet + 3 s timeout = 4.35 s |" in text


@pytest.mark.unit
def test_check_exits_1_with_a_unified_diff_on_drift(gen_docs, tmp_path, capsys):
    shutil.copy(README, tmp_path / "README.md")
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("*.png"))
    page = tmp_path / "docs" / "reference" / "configuration.md"
    text = page.read_text("utf-8")
    row = next(line for line in text.splitlines() if line.startswith("| `SIDECAR_LIVENESS_WINDOW`"))
    page.write_text(text.replace(row, row.replace("`120`", "`60`")), "utf-8")

    assert gen_docs.main(["--check"], root=tmp_path) == 1
    out = capsys.readouterr().out
    assert "--- docs/reference/configuration.md (committed)" in out
    assert "+++ docs/reference/configuration.md (from the code)" in out
    assert "-" + row.replace("`120`", "`60`") in out
    assert "+" + row in out

    assert gen_docs.main([], root=tmp_path) == 0  # rewrites it
    assert page.read_text("utf-8") == text


# --- the decision tables hold for the functions --------------------------------------------------
POLICY = Policy(wait=1.0, retry=1.0, timeout=0.5, liveness_window=10.0, stall_window=2.5)


def _result(outcome: Outcome, at: float, status: int | None = None) -> Result:
    if outcome is Outcome.SUCCESS:
        status = 200
    return Result(outcome, f"GET /health -> {status}", at, at + 0.01, 1e9 + at, "canary-x", status)


def _registered(has_canary: bool = True) -> EndpointState:
    fresh = EndpointState("generate", has_canary, "why")
    return apply_registration(fresh, _result(Outcome.SUCCESS, 0.0), POLICY)


def _passed() -> EndpointState:
    ep = _registered()
    return apply_canary(ep, _result(Outcome.SUCCESS, 0.1), ep.incarnation, POLICY)


def _hung() -> EndpointState:
    """Two canary timeouts after a pass, while the health route still answers 200."""
    ep = _passed()
    for at in (1.0, 2.0):
        timeout = Result(Outcome.TIMEOUT, "no complete answer within 0.5 s", at, at + 0.5, 1e9)
        ep = apply_canary(ep, timeout, ep.incarnation, POLICY)
    return apply_registration(ep, _result(Outcome.SUCCESS, 3.0), POLICY)


def _maintained() -> EndpointState:
    ep = _passed()
    window = lifecycle.start_maintenance(ep.lifecycle, "weights, step 42", 30.0, 1.0, 1e9)
    return apply_lifecycle(ep, window, 1.0)


def _asleep() -> EndpointState:
    ep = _passed()
    asleep = lifecycle.on_sleep_route(ep.lifecycle, True, "GET /is_sleeping -> true", 1.0)
    return apply_lifecycle(ep, asleep, 1.0)


def _orphaned() -> EndpointState:
    ep = _passed()
    ep = apply_discovery(ep, True, "dyn://ns.worker.generate/7", 1.0, "etcd")
    return apply_discovery(ep, False, "dyn://ns.worker.generate/7", 2.0, "etcd")


# (registration, canary) as the table in sidecar/core/verdict.py writes them -> a state that is so.
ENDPOINT_ROWS: dict[tuple[str, str], Callable[[], EndpointState]] = {
    ("not checked yet", "any"): lambda: EndpointState("generate", True, "why"),
    ("any", "in maintenance"): _maintained,
    ("not registered", "any"): lambda: apply_registration(
        _passed(), _result(Outcome.ERROR, 1.0, 503), POLICY
    ),
    ("not discoverable", "any"): _orphaned,
    ("registered", "engine asleep"): _asleep,
    ("registered", "engine reports a fault or recovers"): lambda: apply_faults(
        _passed(), 0, EngineReport("unhealthy", "RuntimeError"), 2.0
    ),
    ("registered", "none for this role"): lambda: _registered(has_canary=False),
    ("registered", "no result yet"): _registered,
    ("registered", "ready"): _passed,
    ("registered", "notready"): _hung,
}
VERDICTS = {"ready": True, "notready": False, "none": None}


def reason_pattern(cell: str) -> re.Pattern[str]:
    """A documented reason as a pattern: what precedes "..." literally, <placeholders>, N, R, M
    and ``need`` as anything."""
    text = cell.split("...")[0].strip()
    out = ""
    for token in re.split(r"(<[^>]*>|``need``|`need`|\b[NRM]\b)", text):
        if token.startswith("<"):
            out += ".+?"
        elif token in ("``need``", "`need`", "N", "R", "M"):
            out += r"\d+"
        else:
            out += re.escape(token)
    return re.compile(out)


def _table(doc: str | None, gen_docs: ModuleType) -> list[list[str]]:
    assert doc
    return gen_docs.parse_rst_tables(doc)[0]


@pytest.mark.unit
def test_the_verdict_table_names_a_state_for_each_row(gen_docs):
    head, *rows = _table(verdict.__doc__, gen_docs)
    assert head == ["registration", "canary", "verdict", "reason"]
    assert {(r[0], r[1]) for r in rows} == set(ENDPOINT_ROWS), "a row without a state here"


def _endpoint_rows() -> Iterator[list[str]]:
    yield from load_gen_docs().parse_rst_tables(verdict.__doc__ or "")[0][1:]


@pytest.mark.unit
@pytest.mark.parametrize("row", list(_endpoint_rows()), ids=lambda r: f"{r[0]}, {r[1]}")
def test_each_row_of_the_verdict_table_holds(row):
    registration, canary, documented, reason = row
    ep = ENDPOINT_ROWS[(registration, canary)]()
    got = endpoint_verdict(ep, POLICY, 5.0)
    assert got.ready is VERDICTS[documented], got
    if reason.startswith("the canary's reason"):
        assert got.reason.startswith(ep.canary.reason), got.reason
        assert got.reason.endswith(verdict.DISAGREES), got.reason  # "... when so": it is here
    else:
        assert reason_pattern(reason).match(got.reason), (reason, got.reason)


def _v(ready: bool | None, reason: str = "r") -> Verdict:
    return Verdict(ready, reason)


# The ranks column of rank_verdict's table -> (its rank verdicts, need).
RANK_ROWS: dict[str, tuple[dict[str, Verdict], int | None]] = {
    "every one ready": ({"generate/rank0": _v(True), "generate/rank1": _v(True)}, None),
    "at least `need` ready, others not": (
        {"generate/rank0": _v(True), "generate/rank1": _v(False, "canary timeout")},
        1,
    ),
    "fewer ready, but the undecided could make up `need`": (
        {"generate/rank0": _v(True), "generate/rank1": _v(None)},
        2,
    ),
    "fewer ready": ({"generate/rank0": _v(True), "generate/rank1": _v(False, "hung")}, 2),
}


def _rank_rows() -> list[list[str]]:
    rows = load_gen_docs().parse_rst_tables(rank_verdict.__doc__ or "")[0][1:]
    return [[cell.replace("``", "`") for cell in row] for row in rows]


@pytest.mark.unit
def test_the_rank_table_names_units_for_each_row():
    assert {r[0] for r in _rank_rows()} == set(RANK_ROWS)


@pytest.mark.unit
@pytest.mark.parametrize("row", _rank_rows(), ids=lambda r: r[0])
def test_each_row_of_the_rank_table_holds(row):
    ranks, documented, reason = row
    units, need = RANK_ROWS[ranks]
    got = rank_verdict(units, need)
    ready, *degraded = documented.split()
    assert got.ready is VERDICTS[ready], got
    assert got.degraded is (degraded == ["degraded"]), got
    assert reason_pattern(reason).match(got.reason), (reason, got.reason)


# --- the metrics table -------------------------------------------------------------------------
def _exported(monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[str, set[str] | None]]:
    """Every series the sidecar's /metrics declares: name -> (type, labels or None when it has
    no sample to show them), from its real exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    from sidecar.wiring import health_for, resolve, surface_for

    blueprint = resolve(settings_from(monkeypatch, DYN_HEALTH_CHECK_ENABLED="true"))
    text = surface_for(blueprint, health_for(blueprint)).metrics.exposition().decode()
    found = {}
    for family in text_string_to_metric_families(text):
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {k for s in family.samples for k in s.labels} - {"le"}
        found[name] = (family.type, labels if family.samples else None)
    return found


def _documented() -> dict[str, tuple[str, set[str]]]:
    page = (ROOT / "docs" / "reference" / "metrics.md").read_text("utf-8")
    rows = re.findall(r"^\| `(health_sidecar_\w+)(?:\{([\w,]+)\})?` \| (\w+) \|", page, re.M)
    return {
        name: (kind, set(labels.split(",")) if labels else set()) for name, labels, kind in rows
    }


@pytest.mark.unit
def test_the_metrics_table_names_exactly_what_is_exported(monkeypatch):
    exported, documented = _exported(monkeypatch), _documented()
    assert set(documented) == set(exported), (
        f"undocumented: {sorted(set(exported) - set(documented))}; "
        f"not exported: {sorted(set(documented) - set(exported))}"
    )
    for name, (kind, labels) in documented.items():
        real_kind, real_labels = exported[name]
        assert {"info": "gauge"}.get(kind, kind) == real_kind, name
        if real_labels is not None:
            assert labels == real_labels, name


@pytest.mark.unit
def test_the_metrics_table_gives_every_scrape_time_family_its_type_and_labels():
    """The collector's rows as the docs table says, label names included for the families a
    fresh sidecar shows no sample of (ranks, KV transfers, liveness clocks)."""
    from sidecar.surface.metrics import EP, PREFIX, ROWS, WorkerRow

    documented = _documented()
    for row in ROWS:
        name = f"{PREFIX}_{row.name}" + {"counter": "_total", "info": "_info"}.get(row.kind, "")
        assert documented.get(name) == (row.kind, set(row.labels)), name
        if not isinstance(row, WorkerRow):  # the collector fills the endpoint label first
            assert row.labels[: len(EP)] == EP, name


# --- (b) paths, (d) links, defaults, (c) length --------------------------------------------------
def mentioned_paths(text: str) -> set[str]:
    """Paths from the repository's root; link targets are relative to their document, and
    checked apart."""
    found = set()
    for match in PATH.finditer(re.sub(r"\]\([^)]*\)", "]", text)):
        ref = match.group(1).rstrip(".")
        if not any(c in ref for c in "<{$"):
            found.add(ref)
    return found


@pytest.mark.unit
@pytest.mark.parametrize("doc", documents(), ids=_name)
def test_every_mentioned_path_exists(doc: Path):
    missing = [
        ref
        for ref in sorted(mentioned_paths(doc.read_text("utf-8")))
        if not (any(ROOT.glob(ref)) if "*" in ref else (ROOT / ref).exists())
    ]
    assert not missing, f"{_name(doc)} mentions paths that do not exist: {missing}"


@pytest.mark.unit
@pytest.mark.parametrize("doc", documents(), ids=_name)
def test_every_relative_link_resolves(doc: Path):
    text = FENCE.sub("", doc.read_text("utf-8"))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (doc.parent / target.split("#")[0]).exists():
            broken.append(target)
    assert not broken, f"{_name(doc)} links to what does not exist: {broken}"


QUOTED_DEFAULT = re.compile(r"`((?:DYN|SIDECAR)_[A-Z0-9_]+)` \((\d+(?:\.\d+)?)(?: s)?[):,;]")


@pytest.mark.unit
@pytest.mark.parametrize("doc", written_docs(), ids=_name)
def test_defaults_quoted_in_prose_are_the_defaults(doc: Path):
    by_alias = {str(f.validation_alias): f.default for f in Settings.model_fields.values()}
    wrong = [
        (name, value, by_alias[name])
        for name, value in QUOTED_DEFAULT.findall(doc.read_text("utf-8"))
        if name in by_alias and float(value) != by_alias[name]
    ]
    assert not wrong, f"{_name(doc)} quotes defaults that are not (name, quoted, default): {wrong}"


@pytest.mark.unit
def test_the_checks_catch_a_missing_path_and_a_wrong_default():
    assert mentioned_paths("see `sidecar/nope.py` and tests/test_docs.py.") == {
        "sidecar/nope.py",
        "tests/test_docs.py",
    }
    assert not (ROOT / "sidecar/nope.py").exists()
    assert QUOTED_DEFAULT.findall("`SIDECAR_LIVENESS_WINDOW` (60 s) ...") == [
        ("SIDECAR_LIVENESS_WINDOW", "60")
    ]


@pytest.mark.unit
def test_the_readme_stays_short():
    lines = README.read_text("utf-8").count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"


@pytest.mark.unit
def test_the_readme_keeps_the_two_commands():
    text = README.read_text("utf-8")
    for command in (
        "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/health-sidecar demo",
        "python3 -m venv .venv && .venv/bin/pip install -e '.[dev]' && .venv/bin/python -m pytest",
    ):
        assert command in text
