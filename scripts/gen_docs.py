"""Write the generated parts of the docs from the code, or check that they match it.

    .venv/bin/python scripts/gen_docs.py           # rewrite every generated part
    .venv/bin/python scripts/gen_docs.py --check   # exit 1 with a unified diff on any drift

A generated part sits between ``<!-- generated: NAME -->`` and ``<!-- end generated -->`` in
README.md or a file under docs/; the text between the markers is what ``GENERATORS[NAME]``
returns, and the prose around them is written by hand. Every generator must be used somewhere,
and every marker must name a generator.

The sources, one for each fact:

- ``settings``: the variables, from ``sidecar.config.Settings.model_fields`` (the values a
  backend, a transport or a gRPC service may take from the engines' and transports' tables);
- ``engines``: each engine's module and HTTP API, from ``sidecar.engines.ENGINES``;
- ``transports``: the transports, from ``sidecar.transports.TRANSPORTS``; ``role-canaries``: what
  each role's canary carries over each transport, from the probers' own bodies;
- ``policy``: the timings, from ``sidecar.core.evidence.policy.Policy`` (its fields, and its
  properties' formulas read from their source), with their values at ``Policy()`` and at the
  default settings (as ``sidecar.wiring.policy_of`` fills it);
- ``verdict``, ``rank-verdict``, ``rules``: the decision tables and rules, from the docstrings of
  ``sidecar.core.verdict`` and its ``Rule``/``RULE_TEXT`` (tests/test_docs.py evaluates every row of
  the tables against the functions);
- ``cli-help``, ``check-config``, ``probes``: what ``health-sidecar --help``, ``--check-config``
  and ``probes`` print for ``config/vllm-aggregated.env``; ``probes-grpc``: what ``probes --grpc``
  prints for it with ``SIDECAR_GRPC_PORT=50051``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import difflib
import inspect
import json
import os
import re
import sys
import textwrap
from collections.abc import Callable, Iterator, Mapping
from enum import Enum
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: import the checkout's sidecar
    sys.path.insert(0, str(ROOT))

from sidecar.config import Settings  # noqa: E402
from sidecar.core import verdict  # noqa: E402
from sidecar.core.evidence.policy import STALL_WINDOW_DEFAULT, Policy  # noqa: E402
from sidecar.transports import TRANSPORTS  # noqa: E402
from sidecar.transports.seam import shown_body  # noqa: E402
from sidecar.wiring import catalog, check, load, policy_of, resolve  # noqa: E402
from sidecar.wiring.resolve import Blueprint  # noqa: E402

PROFILE = "config/vllm-aggregated.env"
MARKER = re.compile(
    r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S
)
COLUMNS = "100"  # argparse wraps --help to the terminal width


# --- helpers ---------------------------------------------------------------------------------
def _escape(text: str) -> str:
    """Markdown text outside code spans: no pipes, no raw angle brackets, no emphasis."""
    parts = re.split(r"(`[^`]*`)", text)
    for i in range(0, len(parts), 2):
        part = parts[i].replace("|", "\\|").replace("*", "\\*")
        parts[i] = part.replace("<", "&lt;").replace(">", "&gt;")
    return "".join(parts)


def _codify(text: str) -> str:
    """The sidecar's variables as code spans (outside the spans already there)."""
    parts = re.split(r"(`[^`]*`)", text)
    for i in range(0, len(parts), 2):
        parts[i] = re.sub(r"\b((?:DYN|SIDECAR)_[A-Z0-9_]*[A-Z0-9])\b", r"`\1`", parts[i])
    return "".join(parts)


def _cell(text: str) -> str:
    """Text for a markdown table cell: one line, escaped, the variables as code."""
    return _escape(_codify(" ".join(_rst_to_md(str(text)).split())))


def _number(value: float) -> str:
    return f"{value:g}"


def _rst_to_md(text: str) -> str:
    """Docstring markup to markdown: roles and double backticks become code spans."""
    text = re.sub(r":(?:func|mod|class|data|meth|attr):`~?\.?([^`]+)`", r"`\1`", text)
    return re.sub(r"``([^`]+)``", r"`\1`", text)


@contextlib.contextmanager
def clean_environment() -> Iterator[None]:
    """The sidecar's variables removed from the environment (restored after): generated text
    depends on the code and the committed files only."""
    names = {str(f.validation_alias) for f in Settings.model_fields.values()}
    saved = {n: os.environ.pop(n) for n in list(os.environ) if n in names}
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = COLUMNS
    try:
        yield
    finally:
        os.environ.update(saved)
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns


def profile_blueprint(profile: str = PROFILE, **env: str) -> Blueprint:
    with clean_environment():
        return resolve(load(str(ROOT / profile), env))


def default_settings() -> Settings:
    with clean_environment():
        return load()


# --- settings ----------------------------------------------------------------------------------
def _default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, Enum):
        return f"`{value.value}`"
    if isinstance(value, tuple | list):
        return f"`{json.dumps(list(value))}`"
    if isinstance(value, float):
        return f"`{_number(value)}`"
    return f"`{value}`"


def settings_table(fields: Mapping[str, Any] | None = None) -> str:
    """One row per variable: its name, what it expects, its default, what it does."""
    fields = Settings.model_fields if fields is None else fields
    choices = catalog().choices
    rows = ["| variable | expected | default | meaning |", "|---|---|---|---|"]
    for name, field in fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        expected = str(extra.get("expected", ""))
        if name in choices:
            expected = "one of " + ", ".join(choices[name])
        rows.append(
            f"| `{field.validation_alias}` | {_cell(expected)} | "
            f"{_default(field.default)} | {_cell(field.description or '')} |"
        )
    return "\n".join(rows)


def transports_table() -> str:
    """One row per transport: its name, what it reaches, SIDECAR_ENGINE_URL, its extra."""
    rows = [
        "| `SIDECAR_TRANSPORT` | reaches | `SIDECAR_ENGINE_URL` | backends | extra | package |",
        "|---|---|---|---|---|---|",
    ]
    for t in TRANSPORTS.values():
        extra = f"`{t.extra}`" if t.extra else "none"
        package = "sidecar/transports/" + type(t).__module__.rpartition(".")[2] + "/"
        rows.append(
            f"| `{t.name}` | {_cell(t.summary)} | {_cell(t.engine_url)} | "
            f"{', '.join(t.backends)} | {extra} | `{package}` |"
        )
    return "\n".join(rows)


def engines_table() -> str:
    """One row per engine: its module and its HTTP API's facts, from ``ENGINES``."""
    from sidecar.core.vocabulary import Mode, Role
    from sidecar.engines import ENGINES

    rows = [
        "| `SIDECAR_BACKEND` | engine | module | registration | metrics | per-step counters | "
        "sleep | fault tolerance | rank pin |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, engine in ENGINES.items():
        api = engine.api(Role(Mode.AGGREGATED))
        module = "sidecar/engines/" + type(engine).__module__.rpartition(".")[2] + ".py"
        steps = ", ".join(f"`{s}`" for s in api.progress.step_series()) or "none"
        pin = f"{api.pin.how} (label `{api.pin.label}`)" if api.pin else "none"
        rows.append(
            f"| `{name}` | {engine.title} | `{module}` | `GET {api.registration_path}` | "
            f"`{api.progress.path}` | {steps} | {_maybe(api.sleep_path)} | "
            f"{_maybe(api.fault_path)} | {_escape(pin)} |"
        )
    return "\n".join(rows)


def _maybe(path: str | None) -> str:
    return f"`{path}`" if path else "none"


# The roles whose canaries carry something, one row each: (row, backend, mode, model type).
NEEDS = (
    (
        "TensorRT-LLM prefill or decode: run it whole, locally (`LocalRun`, DIS-1737)",
        "trtllm",
        "decode",
        "text",
    ),
    ("SGLang prefill or decode: its fake KV transfer (`FakeTransfer`)", "sglang", "decode", "text"),
    ("vLLM decode: a plain local request (no need)", "vllm", "decode", "text"),
    ("an image encoder: a new image per canary (`NewImage`)", "vllm", "encode", "multimodal"),
)


def _role_blueprint(transport: Any, backend: str, mode: str, model_type: str) -> Blueprint | None:
    url = "grpc://127.0.0.1:50051" if transport.grpc_url else "http://127.0.0.1:8000"
    fields = {
        "SIDECAR_TRANSPORT": transport.name,
        "SIDECAR_ENGINE_URL": url,
        "SIDECAR_BACKEND": backend,
        "SIDECAR_DISAGGREGATION_MODE": mode,
        "SIDECAR_MODEL_TYPE": model_type,
        "DYN_HEALTH_CHECK_ENABLED": "true",
        "DYN_VLLM_EMBEDDING_TRANSFER_MODE": "local",
    }
    settings = Settings.model_validate(fields)
    if check(settings):
        return None
    return resolve(settings)


def _carried(b: Blueprint, plain: Blueprint | None) -> str:
    """What this role's canary carries beyond the same transport's aggregated one."""
    plan = b.plan
    if not plan.enabled:
        return "none: " + plan.why.split(";")[0]
    if plan.role.encoder or plain is None:
        return plan.why
    body, base = shown_body(plan, b.settings), shown_body(plain.plan, plain.settings)
    more = {k: v for k, v in body.items() if base.get(k) != v}
    return f"`{json.dumps(more)}`" if more else "nothing: the plain request"


def role_canaries_table() -> str:
    """What each role needs, and how each transport's wire carries it, from the probers."""
    rows = [
        "| the engine's rule | " + " | ".join(f"`{t}`" for t in TRANSPORTS) + " |",
        "|---|" + "---|" * len(TRANSPORTS),
    ]
    for title, backend, mode, model_type in NEEDS:
        cells = []
        for transport in TRANSPORTS.values():
            b = _role_blueprint(transport, backend, mode, model_type)
            if b is None:
                cells.append(f"not reached ({backend} over {transport.name})")
                continue
            plain = _role_blueprint(transport, backend, "aggregated", "text")
            cells.append(_cell(_carried(b, plain)))
        rows.append(f"| {_escape(title)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


# --- policy ------------------------------------------------------------------------------------
def _setting_names() -> dict[str, str]:
    """Policy field -> the Settings attribute ``policy_of`` fills it from (read from its source,
    so a field wired to another setting shows here)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(policy_of)))
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and n.keywords)
    return {k.arg: ast.unparse(k.value).removeprefix("s.") for k in call.keywords if k.arg}


def _settings_ref(attr: str) -> str:
    field = Settings.model_fields.get(attr)
    if field is not None:
        return f"`{field.validation_alias}`"
    if attr == "stall_window_of(s)":
        return f"`SIDECAR_STALL_WINDOW` (unset: {STALL_WINDOW_DEFAULT})"
    return f"`{attr}`"


def _formula(cls: type, name: str) -> str:
    """The expression a property returns, as written in its source, without ``self.``."""
    source = textwrap.dedent(inspect.getsource(getattr(cls, name).fget))
    tree = ast.parse(source)
    returns = [n for n in ast.walk(tree) if isinstance(n, ast.Return) and n.value is not None]
    if len(returns) != 1:
        raise ValueError(f"{cls.__name__}.{name}: expected one return, found {len(returns)}")
    return ast.unparse(returns[0].value).replace("self.", "")


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return _number(value)
    return str(value)


# The bounds the policy makes, each a sum of named terms (sidecar/core/evidence/policy.py).
BOUNDS = ("to_ready", "to_notready", "to_notlive", "to_stalled", "to_stalled_from_idle")


def _bound(policy: Policy, name: str) -> str:
    made = getattr(policy, name)()
    return f"{made} = {_number(made.seconds)} s"


def policy_section(policy_cls: type = Policy) -> str:
    """The policy's fields and derived timings, with their values at ``Policy()`` and at the
    default settings."""
    bare = policy_cls()
    settings = default_settings()
    configured = policy_of(settings)
    if policy_cls is not Policy:
        configured = policy_cls(**dataclasses.asdict(configured))
    wired = _setting_names()
    lines = [
        "| `Policy` field | from the setting | `Policy()` | default settings |",
        "|---|---|---|---|",
    ]
    for f in dataclasses.fields(policy_cls):
        source = _settings_ref(wired[f.name]) if f.name in wired else "(not from settings)"
        lines.append(
            f"| `{f.name}` | {source} | {_value(getattr(bare, f.name))} | "
            f"{_value(getattr(configured, f.name))} |"
        )
    lines += [
        "",
        "| derived | formula | `Policy()` | default settings | what it is |",
        "|---|---|---|---|---|",
        f"| `suspect_after` | `{_formula(policy_cls, 'suspect_after')}` | "
        f"{_value(bare.suspect_after)} s | {_value(configured.suspect_after)} s | "
        f"{_cell(policy_cls.suspect_after.__doc__ or '')} |",
        "",
        "| bound, at the longest | `Policy()` | default settings | what it is |",
        "|---|---|---|---|",
    ]
    for name in BOUNDS:
        doc = getattr(policy_cls, name).__doc__ or ""
        lines.append(
            f"| `{name}()` | {_bound(bare, name)} | {_bound(configured, name)} | {_cell(doc)} |"
        )
    return "\n".join(lines)


# --- the verdict -------------------------------------------------------------------------------
def parse_rst_tables(doc: str) -> list[list[list[str]]]:
    """The simple RST tables of a docstring: each a list of rows (the header first), each row a
    list of cells. A line whose first cell is blank continues the row above it."""
    lines = inspect.cleandoc(doc).splitlines()
    tables, i = [], 0
    while i < len(lines):
        if not re.fullmatch(r"=+( +=+)+", lines[i].strip()):
            i += 1
            continue
        starts = [m.start() for m in re.finditer("=+", lines[i])]
        borders, rows, i = 1, [], i + 1
        while i < len(lines) and borders < 3:
            line = lines[i]
            if re.fullmatch(r"=+( +=+)+", line.strip()):
                borders += 1
            elif line.strip():
                ends = [*starts[1:], len(line)]
                cells = [line[a:b].strip() for a, b in zip(starts, ends, strict=True)]
                # A row starts where its first two cells are written; other lines continue it.
                if all(cells[:2]) or not rows:
                    rows.append(cells)
                else:
                    rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells, strict=True)]
            i += 1
        tables.append(rows)
    return tables


def _md_table(rows: list[list[str]]) -> str:
    head, *body = rows
    out = ["| " + " | ".join(_cell(c) for c in head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in body]
    return "\n".join(out)


def docstring_markdown(doc: str) -> str:
    """A docstring as markdown: its tables as tables, the rest as written."""
    lines = inspect.cleandoc(doc).splitlines()
    tables = iter(parse_rst_tables(doc))
    out, i = [], 0
    while i < len(lines):
        if re.fullmatch(r"=+( +=+)+", lines[i].strip()):
            borders = 0
            while i < len(lines) and borders < 3:
                borders += bool(re.fullmatch(r"=+( +=+)+", lines[i].strip()))
                i += 1
            out.append(_md_table(next(tables)))
            continue
        out.append(_escape(_codify(_rst_to_md(lines[i]))))
        i += 1
    return "\n".join(out)


def verdict_doc() -> str:
    assert verdict.__doc__
    return docstring_markdown(verdict.__doc__)


def liveness_clocks() -> str:
    """The liveness clocks, from ``Cause`` itself."""
    rows = ["| clock (`cause`) | in brief | what starts and ends it |", "|---|---|---|"]
    rows += [f"| {c.value} | {c.brief} | {_cell(c.description)} |" for c in verdict.Cause]
    return "\n".join(rows)


def rank_verdict_doc() -> str:
    doc = verdict.rank_verdict.__doc__ or ""
    return docstring_markdown(doc)


def rules_table() -> str:
    rows = ["| `rule` in /health | means |", "|---|---|"]
    rows += [f"| `{rule.value}` | {_cell(verdict.RULE_TEXT[rule])} |" for rule in verdict.Rule]
    return "\n".join(rows)


# --- the command line --------------------------------------------------------------------------
def cli_help() -> str:
    from sidecar.tools import cli

    with clean_environment():
        text = cli._parser().format_help()
    return f"```text\n$ health-sidecar --help\n{text.rstrip()}\n```"


def check_config() -> str:
    from sidecar.tools.plan import render

    text = render(profile_blueprint())
    return f"```text\n$ health-sidecar --env-file {PROFILE} --check-config\n{text}\n```"


def probes() -> str:
    from sidecar.tools.probes import render

    text = render(profile_blueprint(), 7200.0)
    command = f"health-sidecar --env-file {PROFILE} probes --max-load-seconds 7200"
    return f"```yaml\n# $ {command}\n{text}\n```"


def exit_statuses() -> str:
    from sidecar.runtime.exits import EXIT_STATUSES

    rows = ["| status | means |", "|---|---|"]
    rows += [f"| {code} | {_escape(text)} |" for code, text in EXIT_STATUSES.items()]
    return "\n".join(rows)


GRPC_PORT = "50051"  # the port of the probes-grpc example (and of Dynamo's gRPC probes, #14927)


def probes_grpc() -> str:
    from sidecar.tools.probes import render

    text = render(profile_blueprint(SIDECAR_GRPC_PORT=GRPC_PORT), 7200.0, grpc=True)
    command = (
        f"SIDECAR_GRPC_PORT={GRPC_PORT} health-sidecar --env-file {PROFILE} probes --grpc "
        "--max-load-seconds 7200"
    )
    return f"```yaml\n# $ {command}\n{text}\n```"


GENERATORS: dict[str, Callable[[], str]] = {
    "settings": settings_table,
    "transports": transports_table,
    "role-canaries": role_canaries_table,
    "engines": engines_table,
    "policy": policy_section,
    "verdict": verdict_doc,
    "liveness-clocks": liveness_clocks,
    "rank-verdict": rank_verdict_doc,
    "rules": rules_table,
    "cli-help": cli_help,
    "exit-statuses": exit_statuses,
    "check-config": check_config,
    "probes": probes,
    "probes-grpc": probes_grpc,
}


# --- the files ---------------------------------------------------------------------------------
def documents(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def regenerate(text: str, generators: Mapping[str, Callable[[], str]], used: set[str]) -> str:
    def fill(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in generators:
            raise KeyError(f"no generator named {name!r}")
        used.add(name)
        return f"{match.group(1)}\n{generators[name]().rstrip()}\n\n{match.group(4)}"

    return MARKER.sub(fill, text)


def drift(
    root: Path = ROOT, generators: Mapping[str, Callable[[], str]] = GENERATORS
) -> dict[Path, tuple[str, str]]:
    """Every document whose generated parts differ from the code: path -> (committed, fresh).
    Raises ValueError when a marker names no generator or a generator is used nowhere."""
    used: set[str] = set()
    changed = {}
    for path in documents(root):
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        try:
            fresh = regenerate(text, generators, used)
        except KeyError as exc:
            raise ValueError(f"{path.relative_to(root)}: {exc.args[0]}") from None
        if fresh != text:
            changed[path] = (text, fresh)
    unused = sorted(set(generators) - used)
    if unused:
        raise ValueError(f"generated parts used by no document: {', '.join(unused)}")
    return changed


def diff(path: Path, old: str, new: str, root: Path = ROOT) -> str:
    name = str(path.relative_to(root))
    return "".join(
        difflib.unified_diff(
            old.splitlines(keepends=True),
            new.splitlines(keepends=True),
            fromfile=f"{name} (committed)",
            tofile=f"{name} (from the code)",
        )
    )


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 with a diff on any drift"
    )
    args = parser.parse_args(argv)
    try:
        changed = drift(root)
    except ValueError as exc:
        print(f"gen_docs: {exc}", file=sys.stderr)
        return 2
    for path, (old, new) in changed.items():
        if args.check:
            sys.stdout.write(diff(path, old, new, root))
        else:
            path.write_text(new, encoding="utf-8")
            print(f"gen_docs: wrote {path.relative_to(root)}")
    if args.check and changed:
        print(
            "gen_docs: the docs drifted from the code; run .venv/bin/python scripts/gen_docs.py",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
