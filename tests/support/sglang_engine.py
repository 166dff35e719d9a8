"""A real SGLang (0.5.23, its CPU engine) for integration tests, on loopback inside a private
network namespace.

``scripts/prepare_engines.sh --only sglang`` installs it and writes ``SGLANG_PYTHON``,
``SGLANG_SITE_DIR`` and ``SGLANG_MODEL_DIR`` to ``engines.env``; without them the tests skip
naming the script (fail under CI), like the other real engines in ``tests/support/engines.py``.

One server is ``python -m sglang.launch_server`` (the HTTP server and tokenizer manager, started
here in its own process group) and its children: one ``sglang::scheduler`` per data-parallel rank
(titled ``sglang::scheduler_DP<rank>`` with ``--dp-size`` > 1, under a
``sglang::data_parallel_controller``), ``sglang::detokenizer`` and multiprocessing's resource
tracker. The scheduler runs the model's step loop: freezing it (SIGSTOP) is a hung engine.

SGLang's scheduler and mooncake open listeners on all interfaces whatever the host flags say, so
start servers only inside ``tests.support.netns`` (the module fixture ``isolated``): the server and
every
client of it then share a loopback that nothing else reaches. The server runs niced (19, its
session weighted like a pod's cgroup: ``tests.support.processes.weigh_session``) and with
``--sleep-on-idle`` (else an idle scheduler spins a core at 100 %). Start-up takes 14-23 s alone
on 2 cores (20-53 s with ``dp_size=2``), about 2 GB of RSS per server: share servers through
module-scoped fixtures (:func:`sglang_server`).

Modes: "aggregated"; "decode" with the fake transfer backend (a request carrying
``bootstrap_host`` "2.2.2.2" runs locally; **a request without ``bootstrap_host`` crashes the
whole server**: the client's connection drops and the server exits -9 about 5 s later);
"prefill" with the mooncake_tcp backend and a bootstrap port of its own (a request needs a
``bootstrap_room``, else 400; its answer says ``finish_reason`` length 0 with 1 output id).

What the routes do (measured here): ``/health`` is a 1-token generation that answers 200 about
1 s after *any* output reached the tokenizer manager, else 503 after 20 s; with one of two DP
ranks frozen it answers 503 or 200 by where round-robin sends it (and 200 whenever other work
answers). ``/v1/models`` and ``/metrics`` answer 200 while a scheduler is frozen. The
scheduler's time counters (``scheduler_idle_seconds_total``, ``scheduler_stage_seconds_total``,
``scheduler_process_cpu_seconds_total``) advance about once a second even when idle, and stop
when the scheduler is frozen; the token counters advance only with work.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
from collections.abc import Iterator
from typing import Any

import httpx

from tests.support.engines import require
from tests.support.exposition import samples, total
from tests.support.harness import Sidecar
from tests.support.processes import LOOPBACK, MetricsServer, base_env, free_port, wait_until

MODEL = "tiny"
MODES = ("aggregated", "prefill", "decode")
START_TIMEOUT = 300.0  # 14-23 s alone (20-53 s with dp 2); far more beside other engines
ENGINE_NICE = 19  # as tests.support.vllm_engine: the engine must not starve the sidecar on 2 cores
SCHEDULER = "sglang::scheduler"
DETOKENIZER = "sglang::detokenizer"
DP_CONTROLLER = "sglang::data_parallel_controller"
FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # SGLang's fake transfer: no peer is contacted
CANARY_PROMPT = list(range(100, 108))  # 8 ordinary ids of the tiny model's 512-token vocabulary
_SCHEDULER_RANK = re.compile(r"_DP(\d+)")

# The flags every server here gets (the reference set for SGLang's CPU engine on this machine).
BASE_FLAGS = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--sampling-backend",
    "pytorch",
    "--disable-overlap-schedule",
    "--cuda-graph-backend-decode=disabled",
    "--cuda-graph-backend-prefill=disabled",
    "--dtype",
    "float32",
    "--context-length",
    "512",
    "--max-total-tokens",
    "4096",
    "--enable-metrics",
    "--sleep-on-idle",
)


def scheduler_rank(title: str) -> int:
    """The data-parallel rank of a scheduler from its process title: ``sglang::scheduler_DP1``
    is rank 1; a bare ``sglang::scheduler`` (no data parallelism) is rank 0."""
    match = _SCHEDULER_RANK.search(title)
    return int(match.group(1)) if match else 0


def canary_body(
    max_new_tokens: int = 1,
    *,
    rid: str | None = None,
    bootstrap: bool = False,
    bootstrap_port: int | None = None,
    room: int | None = None,
    prompt: list[int] | None = None,
    dp_rank: int | None = None,
) -> dict[str, Any]:
    """A greedy ``/generate`` body with ``input_ids``; ``bootstrap`` adds SGLang's fake peer
    (``bootstrap_host`` 2.2.2.2, a port and a fresh ``bootstrap_room``) for prefill and decode."""
    body: dict[str, Any] = {
        "input_ids": list(prompt or CANARY_PROMPT),
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
        "rid": rid or f"canary-{random.getrandbits(64):016x}",
    }
    if bootstrap:
        body["bootstrap_host"] = FAKE_BOOTSTRAP_HOST
        body["bootstrap_port"] = bootstrap_port or 8998
        body["bootstrap_room"] = room if room is not None else random.getrandbits(62)
    if dp_rank is not None:
        body["data_parallel_rank"] = dp_rank
    return body


class SglangServer(MetricsServer):
    """``python -m sglang.launch_server`` on a free loopback port, in ``mode`` "aggregated",
    "decode" (fake transfer backend) or "prefill" (mooncake_tcp, its own bootstrap port);
    ``dp_size`` 2 runs two data-parallel schedulers on the same two cores.

    Stopped by SIGTERM to the launcher alone, which drains and ends its children (0 within about
    a second). A SIGTERM to the whole group would kill the schedulers first; the launcher then
    takes that for a crash and kills itself after 5 s of "crash diagnostics" (-9). The group
    gets SIGCONT first (a frozen scheduler) and SIGKILL last (whatever is left)."""

    start_timeout = START_TIMEOUT
    ready_interval = 0.25
    handover_timeout = 30.0
    stop_timeout = 15.0
    stop_group = False
    http_timeout = 5.0

    def __init__(
        self,
        *extra: str,
        mode: str = "aggregated",
        dp_size: int = 1,
        max_running_requests: int | None = None,
        nice: int = ENGINE_NICE,
        env: dict[str, str] | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {MODES}")
        self.paths = require("SGLANG_PYTHON", "SGLANG_SITE_DIR", "SGLANG_MODEL_DIR")
        super().__init__()
        self.mode = mode
        self.dp_size = dp_size
        self.max_running_requests = max_running_requests
        self.nice = nice
        self.extra = list(extra)
        self.extra_env = dict(env or {})
        self.bootstrap_port = free_port() if mode == "prefill" else None

    @property
    def name(self) -> str:
        return f"sglang-{self.mode}" + (f"-dp{self.dp_size}" if self.dp_size > 1 else "")

    def env(self) -> dict[str, str]:
        site = self.paths["SGLANG_SITE_DIR"]
        inherited = os.environ.get("PYTHONPATH")
        env = base_env() | {
            "SGLANG_USE_CPU_ENGINE": "1",
            # The sgl_kernel stand-in and the sitecustomize (torchvision, mooncake fixes).
            "PYTHONPATH": os.pathsep.join(p for p in (site, inherited) if p),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "DO_NOT_TRACK": "1",
            "SGLANG_HOST_IP": LOOPBACK,  # what can be told to stay on loopback, does
            "MC_TCP_BIND_ADDRESS": LOOPBACK,
            "GLOO_SOCKET_IFNAME": "lo",
        }
        if self.dp_size > 1:
            # Both ranks on both cores (else start-up asserts one rank per NUMA node).
            env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(["0-1"] * self.dp_size)
        return env | self.extra_env

    def argv(self) -> list[str]:
        argv = [self.paths["SGLANG_PYTHON"], "-m", "sglang.launch_server"]
        argv += ["--model-path", self.paths["SGLANG_MODEL_DIR"], "--served-model-name", MODEL]
        argv += [*BASE_FLAGS, "--host", LOOPBACK, "--port", str(self.port)]
        if self.mode == "decode":
            argv += ["--disaggregation-mode", "decode"]
            argv += ["--disaggregation-transfer-backend", "fake"]
            # The default backup ("cuda") dies on the CPU: Torch not compiled with CUDA enabled.
            argv += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
        elif self.mode == "prefill":
            argv += ["--disaggregation-mode", "prefill"]
            argv += ["--disaggregation-transfer-backend", "mooncake_tcp"]
            argv += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        if self.dp_size > 1:
            argv += ["--dp-size", str(self.dp_size)]
        if self.max_running_requests is not None:
            argv += ["--max-running-requests", str(self.max_running_requests)]
        return argv + self.extra

    def ready(self) -> bool:
        """The model in ``/v1/models`` (200), then ``/health`` 200 (a 1-token generation in
        0.5.23)."""
        answer = self.http.get(f"{self.url}/v1/models", timeout=2)
        if answer.status_code != 200:
            return False
        if not any(m.get("id") == MODEL for m in answer.json().get("data", [])):
            return False
        return self.http.get(f"{self.url}/health", timeout=10).status_code == 200

    # --- processes ------------------------------------------------------------------------
    def scheduler_pids(self, timeout: float = 10) -> dict[int, int]:
        """dp_rank -> pid of its ``sglang::scheduler`` process (one per rank; the rank is read
        from the title's ``_DP<rank>`` suffix, see :func:`scheduler_rank`)."""

        def find() -> dict[int, int] | None:
            ranks = {
                scheduler_rank(title): pid
                for pid, title in self.processes().items()
                if title.startswith(SCHEDULER)
            }
            return ranks if len(ranks) == self.dp_size else None

        return wait_until(find, timeout, interval=0.1, what=f"{SCHEDULER} under {self.name}")

    # --- HTTP -----------------------------------------------------------------------------
    def status(self, path: str, timeout: float = 2) -> int | None:
        """The status ``GET path`` answers, or None when it does not (refused, timed out)."""
        try:
            return self.http.get(f"{self.url}{path}", timeout=timeout).status_code
        except httpx.HTTPError:
            return None

    def generate(self, body: dict[str, Any], timeout: float = 30) -> httpx.Response:
        return self.http.post(f"{self.url}/generate", json=body, timeout=timeout)

    def canary(self, max_new_tokens: int = 1, timeout: float = 30, **kw: Any) -> httpx.Response:
        """A canary for this server's mode: decode and prefill get the fake bootstrap peer."""
        bootstrap = self.mode != "aggregated"
        port = self.bootstrap_port
        body = canary_body(max_new_tokens, bootstrap=bootstrap, bootstrap_port=port, **kw)
        return self.generate(body, timeout)


class SglangEncoder(SglangServer):
    """SGLang's encoder of E/P/D (``--encoder-only``) with the tiny Qwen2-VL
    (``SGLANG_MM_MODEL_DIR``) and the site directory ``SGLANG_MM_SITE_DIR`` alone on
    ``PYTHONPATH`` (it runs the project's SGLang fixes too). One process: the launcher runs HTTP,
    the encoder's scheduler and the vision model on one event loop, so freezing it (SIGSTOP) is a
    hung encoder whose every route gives no answer. It serves ``/health`` (an encode of a 32x32
    test image), ``/encode`` and 404 for the rest: it is ready on ``/health`` 200."""

    stop_group = True  # one process (and nothing that mistakes a group SIGTERM for a crash)

    def __init__(self, *extra: str) -> None:
        self.paths = require("SGLANG_PYTHON", "SGLANG_MM_SITE_DIR", "SGLANG_MM_MODEL_DIR")
        MetricsServer.__init__(self)
        self.mode = "encode"
        self.dp_size = 1
        self.max_running_requests = None
        self.nice = ENGINE_NICE
        self.extra = list(extra)
        self.extra_env = {}
        self.bootstrap_port = None

    @property
    def name(self) -> str:
        return "sglang-encoder"

    def env(self) -> dict[str, str]:
        return super().env() | {"PYTHONPATH": self.paths["SGLANG_MM_SITE_DIR"]}

    def argv(self) -> list[str]:
        argv = [self.paths["SGLANG_PYTHON"], "-m", "sglang.launch_server"]
        argv += ["--model-path", self.paths["SGLANG_MM_MODEL_DIR"], "--served-model-name", MODEL]
        argv += ["--encoder-only", "--device", "cpu", "--dtype", "float32"]
        return [*argv, "--host", LOOPBACK, "--port", str(self.port), *self.extra]

    def ready(self) -> bool:
        return self.http.get(f"{self.url}/health", timeout=30).status_code == 200


@contextlib.contextmanager
def sglang_server(
    *extra: str,
    mode: str = "aggregated",
    dp_size: int = 1,
    max_running_requests: int | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[SglangServer]:
    """One started SGLang server, ended on exit: wrap it in a module-scoped fixture that depends
    on ``isolated`` so that a test module starts it once, in its private network namespace."""
    server = SglangServer(
        *extra, mode=mode, dp_size=dp_size, max_running_requests=max_running_requests, env=env
    )
    try:
        server.start()
        yield server
    finally:
        server.close()


@contextlib.contextmanager
def sglang_encoder() -> Iterator[SglangEncoder]:
    """One started SGLang encoder, ended on exit (in a module fixture that depends on
    ``isolated``, as :func:`sglang_server`)."""
    server = SglangEncoder()
    try:
        server.start()
        yield server
    finally:
        server.close()


# --- the sidecar beside it ------------------------------------------------------------------
def sglang_env(server: SglangServer, mode: str = "aggregated", **extra: str) -> dict[str, str]:
    """The sidecar as a user starts it beside this server, canaries on, in ``mode``."""
    return {
        "DYN_HEALTH_CHECK_ENABLED": "true",
        "SIDECAR_BACKEND": "sglang",
        "SIDECAR_DISAGGREGATION_MODE": mode,
        "SIDECAR_ENGINE_URL": server.url,
    } | extra


def sidecar_metric(side: Sidecar, name: str, **labels: str) -> float:
    """The sum of a sidecar's samples called ``name`` with these labels."""
    return total(samples(side.http.get(f"{side.url}/metrics", timeout=5).text), name, **labels)


def check(side: Sidecar, unit: str = "generate") -> dict[str, Any]:
    """One unit's entry of the sidecar's /health ``checks``."""
    return side.http.get(f"{side.url}/health", timeout=5).json()["checks"][unit]
