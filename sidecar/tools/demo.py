"""``health-sidecar demo``: see the sidecar work in one command.

Reads the configuration as ``serve`` does (environment, then ``--env-file``), with demo defaults
for what neither sets: canaries on, shorter timings than serve's (it says both). Uses the engine
at SIDECAR_ENGINE_URL when one of the configured backend answers there (its model list names a
model, or its registration route, the sidecar's, answers 200); otherwise, and when some other
server answers there (it says so), starts the bundled fake engine of the configured backend and
role (``python -m fakeengine``) on a free loopback port, and ends it on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from sidecar.config import Settings
from sidecar.wiring import Blueprint, resolve

LOOPBACK = "127.0.0.1"
DEMO_DEFAULTS = {
    "DYN_HEALTH_CHECK_ENABLED": "true",
    "DYN_CANARY_WAIT_TIME": "5",
    "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "2",
    "DYN_SYSTEM_HOST": LOOPBACK,
    "SIDECAR_LIVENESS_WINDOW": "30",
}


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def demo_defaults() -> dict[str, str]:
    """DEMO_DEFAULTS, and a port: 9090 when free, else any free one."""
    return DEMO_DEFAULTS | {"DYN_SYSTEM_PORT": str(9090 if port_free(9090) else free_port())}


MODELS_PATH = "/v1/models"
LOOK_TIMEOUT = 1.0  # seconds each route may take to answer the demo's look


@dataclass(frozen=True)
class Found:
    """What answers at the engine's URL: an engine of the configured backend or not, and what each
    route looked at answered (none: nothing answers there)."""

    engine: bool
    answers: tuple[str, ...]


async def look_for_engine(client: httpx.AsyncClient, registration: str) -> Found:
    """Whether the server behind ``client`` answers as an engine: its model list names a model
    (GET /v1/models, as the sidecar finds the served model), or its registration route (the
    prober's, as the sidecar checks it) answers 200. Any other answer is some other server."""
    answers: list[str] = []
    for path in dict.fromkeys((MODELS_PATH, registration)):
        try:
            response = await client.get(path)
        except httpx.TimeoutException:
            answers.append(f"GET {path}: no answer within {LOOK_TIMEOUT:g} s")
            continue
        except httpx.HTTPError as exc:
            if not answers:  # nothing listens (or nothing reachable): no server there at all
                return Found(False, ())
            answers.append(f"GET {path}: {type(exc).__name__}")
            continue
        if path == MODELS_PATH and response.status_code == 200:
            if _model_id(response) is not None:
                return Found(True, (*answers, f"GET {path} lists a model"))
            answers.append(f"GET {path} -> 200 without a model id")
        elif path == registration and response.status_code == 200:
            return Found(True, (*answers, f"GET {path} -> 200"))
        else:
            answers.append(f"GET {path} -> {response.status_code}")
    return Found(False, tuple(answers))


def _model_id(response: httpx.Response) -> str | None:
    try:
        model = response.json()["data"][0]["id"]
    except (ValueError, LookupError, TypeError):
        return None
    return model if isinstance(model, str) and model else None


def _look(url: str, registration: str) -> Found:
    async def look() -> Found:
        client = httpx.AsyncClient(base_url=url, timeout=LOOK_TIMEOUT, trust_env=False)
        async with client:
            return await look_for_engine(client, registration)

    return asyncio.run(look())


def timings(blueprint: Blueprint) -> str:
    """The demo's timings, against serve's defaults, and the bounds they make (from the policy's
    own sums: sidecar/core/evidence/policy.py)."""
    settings = blueprint.settings
    names = ("canary_wait_time", "request_timeout", "liveness_window")
    serve = [Settings.model_fields[name].default for name in names]
    ours = [getattr(settings, name) for name in names]
    demo = [float(DEMO_DEFAULTS[str(Settings.model_fields[n].validation_alias)]) for n in names]
    which = "demo defaults" if ours == demo else "as configured"
    head = (
        f"demo: timings ({which}; serve's defaults: a canary every {serve[0]:g} s, "
        f"{serve[1]:g} s timeout, {serve[2]:g} s liveness window):"
    )
    policy, plan = blueprint.policy, blueprint.plan
    if not plan.enabled:
        return (
            f"{head}\n  no canary ({plan.why}): the engine's health route is checked every "
            f"{settings.registration_interval:g} s with a {settings.request_timeout:g} s "
            "timeout; a hang behind its 200 is not seen"
        )
    wait, timeout, window = ours
    return (
        f"{head}\n  a canary every {wait:g} s when ready, {timeout:g} s timeout; notready within "
        f"{policy.to_notready().seconds:g} s of a hang, /live fails within "
        f"{policy.to_notlive().seconds:g} s ({window:g} s liveness window)"
    )


@contextlib.contextmanager
def _fake_engine(backend: str, mode: str) -> Iterator[str]:
    if importlib.util.find_spec("fakeengine") is None:  # the image installs the sidecar alone
        raise SystemExit(
            "health-sidecar demo: no engine to use, and the fake engine is not installed "
            "(pip install -e . from a clone has it)"
        )
    # The port file's folder goes with the fake engine: removed once the engine has ended.
    with tempfile.TemporaryDirectory(prefix="health-sidecar-demo-") as folder:
        port_file = Path(folder) / "port"
        argv = [sys.executable, "-m", "fakeengine", "--backend", backend, "--mode", mode]
        argv += ["--host", LOOPBACK, "--port", "0", "--port-file", str(port_file)]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + 15
            while not port_file.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("health-sidecar demo: the fake engine did not start")
                time.sleep(0.05)
            yield f"http://{LOOPBACK}:{port_file.read_text().strip()}"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def run(blueprint: Blueprint) -> int:
    from sidecar.wiring import run as serve

    settings = blueprint.settings
    base = f"http://{settings.system_host}:{settings.system_port}"
    api = blueprint.engine.api(blueprint.plan.role)
    found = _look(settings.engine_url, settings.registration_path or api.registration_path)
    with contextlib.ExitStack() as stack:
        hint = ""
        backend, mode = settings.backend, settings.disaggregation_mode.value
        if found.engine:
            print(
                f"demo: using the {backend} engine that answers at {settings.engine_url} "
                f"({found.answers[-1]})"
            )
        else:
            where = (
                f"{settings.engine_url} answers, but not as a {backend} engine "
                f"({', '.join(found.answers)})"
                if found.answers
                else f"no engine answers at {settings.engine_url}"
            )
            print(f"demo: {where}; starting the fake {backend} engine ({mode})")
            url = stack.enter_context(_fake_engine(backend, mode))
            blueprint = resolve(settings.model_copy(update={"engine_url": url}))
            fault = f"curl -s -X POST {url}/_fake/fault -H 'Content-Type: application/json'"
            hint = (
                f"""  hang the engine's GPU loop:  {fault} -d '{{"hang_generation": true}}'\n"""
                f"""  and release it:              {fault} -d '{{"hang_generation": false}}'\n"""
            )
        print(
            f"demo: sidecar on {base} (Ctrl-C to stop). Try:\n"
            f"  curl -s {base}/health\n  curl -s {base}/live\n  curl -s {base}/metrics\n{hint}"
            f"{timings(blueprint)}",
            flush=True,
        )
        return serve(blueprint)
