"""The sidecar's HTTP surface against its own OpenAPI schema, and what its routes do with requests
they did not ask for: no 5xx, no crash, queries and bodies ignored, the verdict unchanged.

Schemathesis fuzzes the schema the running sidecar serves (``GET /openapi.json``) with its own
runner (``st run``, every check, coverage and fuzzing phases) through the sidecar's real HTTP
server, so what is checked is what is served: the process tier. ``pytest``-side integration
(``schemathesis.pytest.from_fixture``) does not work with pytest 9 (it sets ``Function._nodeid``,
which pytest 9 no longer has), hence the command line.

The rest is the app's decision, shown in-process (the unit tier): the schema's contract, and the
routes' answers to any query, body, header or method, against a sidecar whose state stands
still (run on a virtual clock until ready, then its monitor stopped and its clock held).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.engineprocess import ProcessLink
from tests.support.harness import Sidecar, wait_until
from tests.support.inprocess import run_virtually
from tests.support.inprocess import running as running_in_process

QUIET_DRAIN = {"SIDECAR_DRAIN_TIMEOUT": "0.1"}  # stop promptly at teardown (SIGTERM drains)
CANARY_ON = QUIET_DRAIN | {
    "DYN_HEALTH_CHECK_ENABLED": "true",
    "DYN_CANARY_WAIT_TIME": "1",
    "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "0.5",
}
PROBES = ("/health", "/live", "/sidecar/live")
ROUTES = (*PROBES, "/metrics")
# The 503 of a notready or notlive worker is the contract, documented in the schema; any other
# 5xx (and a 503 on a route that does not document it: status_code_conformance) is a failure.
NOTREADY_CONFIG = """
[checks.not_a_server_error]
expected-statuses = ["2XX", "3XX", "4XX", "503"]
"""


def st_binary() -> str:
    found = Path(sys.executable).with_name("st")
    if found.exists():
        return str(found)
    on_path = shutil.which("st")
    assert on_path, "schemathesis' st command is not installed (dev dependency)"
    return on_path


def schemathesis_run(side: Sidecar, workdir: Path, config: str | None = None) -> str:
    argv = [st_binary(), "--no-color"]
    if config is not None:
        path = workdir / "schemathesis.toml"
        path.write_text(config)
        argv += ["--config-file", str(path)]
    argv += [
        "run",
        f"{side.url}/openapi.json",
        "--checks",
        "all",
        "--max-examples",
        "50",
        "--workers",
        "1",
        "--generation-database",
        "none",
        "--request-timeout",
        "5",
    ]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=120, cwd=workdir, check=False
    )
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    assert "No issues found" in report, report
    return report


@pytest.mark.process
def test_schemathesis_ready_sidecar_no_server_error(engine, sidecar, tmp_path: Path) -> None:
    """A ready, live sidecar: canaries on, against the fake engine."""
    fake = engine("vllm")
    ready = sidecar(CANARY_ON | {"SIDECAR_ENGINE_URL": fake.url})
    ready.wait_status(200, 5)
    report = schemathesis_run(ready, tmp_path)
    assert "Operations:       8 selected / 8 total" in report, report
    assert ready.proc.popen.poll() is None, "the sidecar died under schemathesis"
    assert ready.get("/health").status_code == 200
    assert ready.get("/live").status_code == 200


@pytest.mark.process
def test_schemathesis_notready_sidecar_no_server_error(engine, sidecar, tmp_path: Path) -> None:
    """Notready with a failing canary: the 503 body is built from the richest state."""
    fake = engine("vllm")
    fake.fault(generation_status=500, generation_error="CUDA error: out of memory")
    side = sidecar(CANARY_ON | {"SIDECAR_ENGINE_URL": fake.url})

    def failed_canary() -> bool:
        last = side.health()[1]["checks"]["generate"]["last_canary"]
        return last is not None and last["outcome"] == "error"

    wait_until(failed_canary, 5, what="a failed canary")
    assert side.get("/health").status_code == 503
    schemathesis_run(side, tmp_path, NOTREADY_CONFIG)
    assert side.proc.popen.poll() is None, "the sidecar died under schemathesis"
    assert side.get("/health").status_code == 503
    assert side.get("/metrics").status_code == 200


@pytest.mark.unit
def test_schema_lists_exactly_the_contract(settled: AppClient) -> None:
    paths = settled.get("/openapi.json").json()["paths"]
    assert set(paths) == set(ROUTES)
    for path in PROBES:
        assert set(paths[path]) == {"get", "head"}, path
        assert {"200", "503"} <= set(paths[path]["get"]["responses"]), path


@pytest.mark.unit
def test_schema_operation_ids_are_unique(settled: AppClient) -> None:
    paths = settled.get("/openapi.json").json()["paths"]
    ids = [op["operationId"] for ops in paths.values() for op in ops.values()]
    assert len(ids) == len(set(ids)), ids


# --- requests the routes did not ask for ---------------------------------------------------------

QUERY_TEXT = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=30
)
QUERIES = st.dictionaries(QUERY_TEXT, QUERY_TEXT, max_size=4)
BODIES = st.one_of(
    st.binary(max_size=2048),
    st.dictionaries(QUERY_TEXT, st.integers() | QUERY_TEXT, max_size=5).map(
        lambda d: json.dumps(d).encode()
    ),
)
HEADER_VALUES = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=40)
HEADERS = st.dictionaries(
    st.sampled_from(["x-debug", "x-forwarded-for", "content-type", "x-state", "cookie", "accept"]),
    HEADER_VALUES,
    max_size=3,
)
UNSAFE_METHODS = ("POST", "PUT", "DELETE", "PATCH", "OPTIONS")


def stable(body: dict[str, Any]) -> dict[str, Any]:
    """A /health or /live body without the fields that change with time alone."""
    return {k: v for k, v in body.items() if k not in ("uptime", "monitor_heartbeat_age_seconds")}


URL = "http://engine:8000"


def settled_app() -> FastAPI:
    """The app of a ready sidecar whose state stands still: run in-process on a virtual clock
    until one canary passed (the next an hour away), then its monitor stopped and the clock its
    answers read held where it stopped."""

    async def main() -> FastAPI:
        engine = ProcessLink("vllm")
        env = CANARY_ON | {"SIDECAR_ENGINE_URL": URL, "DYN_CANARY_WAIT_TIME": "3600"}
        async with running_in_process(env, {URL: engine}) as side:
            await side.wait_status(200, 5)
            held = side.now()
            side.health.clock = lambda: held  # type: ignore[method-assign]
            return side.surface.app

    return run_virtually(main)


class AppClient:
    """A plain client of an app in-process: each request one ``asyncio.run`` over httpx's ASGI
    transport (no thread, no socket)."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    def request(self, method: str, path: str, **options: Any) -> httpx.Response:
        async def one() -> httpx.Response:
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://side") as client:
                return await client.request(method, path, **options)

        return asyncio.run(one())

    def get(self, path: str) -> httpx.Response:
        return self.request("GET", path)


@pytest.fixture(scope="module")
def settled() -> AppClient:
    """A client of the settled app, in-process (a unit test asks for it first)."""
    return AppClient(settled_app())


@pytest.mark.unit
@given(path=st.sampled_from(ROUTES), query=QUERIES, body=BODIES, headers=HEADERS, data=st.data())
@settings(max_examples=60, deadline=None, database=None)
def test_get_ignores_query_strings_bodies_and_headers(
    settled: AppClient,
    path: str,
    query: dict[str, str],
    body: bytes,
    headers: dict[str, str],
    data: st.DataObject,
) -> None:
    plain = settled.get(path)
    fuzzed = settled.request("GET", path, params=query, content=body, headers=headers)
    assert fuzzed.status_code == plain.status_code == 200
    assert fuzzed.headers["content-type"] == plain.headers["content-type"]
    if path == "/metrics":
        assert fuzzed.text == plain.text
    else:
        assert stable(fuzzed.json()) == stable(plain.json())
    method = data.draw(st.sampled_from(UNSAFE_METHODS), label="method")
    refused = settled.request(method, path, params=query, content=body, headers=headers)
    assert refused.status_code == 405, (method, path, refused.text)
    assert "GET" in refused.headers["allow"]


@pytest.mark.unit
def test_unsafe_methods_leave_the_verdict_unchanged(settled: AppClient) -> None:
    def state() -> tuple[dict[str, Any], str]:
        return stable(settled.get("/health").json()), settled.get("/metrics").text

    before = state()
    for path in ROUTES:
        for method in UNSAFE_METHODS:
            for body in (b"", b'{"status": "notready"}', b"\x00" * 4096):
                answer = settled.request(method, f"{path}?ready=0", content=body)
                assert answer.status_code == 405, (method, path)
    assert state() == before
    assert settled.get("/health").status_code == 200
