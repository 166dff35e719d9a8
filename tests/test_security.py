"""Security: the sidecar talks to SIDECAR_ENGINE_URL only, never shows the engine API key, and
nothing it serves can change its state.

What the sidecar decides (the bearer token on every request, every reason it serves or logs
scrubbed of the key and of credentials an engine echoes, no route that changes its state or sends
a canary) is shown in-process on a virtual clock (the unit tier): the whole sidecar
(``tests/support/inprocess.py``) against the fake engine's app, which records every request it
is sent (``tests/support/engineprocess.py``), and the command line called in-process.

What only a real process shows stays in the process tier, everything on loopback: the sidecar as
users run it, with a recording TCP relay put between it and the engine (it sees every connection
and every request head) and a trap listener named in every proxy variable (it must see nothing);
what the sidecar connects to, read from outside, from its sockets in /proc; the key in the
process's whole output at DEBUG; and what its HTTP server does with bytes that are not a request
the app ever sees.
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sidecar.config import Settings
from sidecar.tools import cli
from tests.support.engineprocess import ProcessLink
from tests.support.harness import LOOPBACK, Sidecar, wait_until
from tests.support.inprocess import InProcessSidecar, run_virtually, running, until

QUIET_DRAIN = {"SIDECAR_DRAIN_TIMEOUT": "0.1"}  # stop promptly at teardown (SIGTERM drains)
CANARY_ON = QUIET_DRAIN | {
    "DYN_HEALTH_CHECK_ENABLED": "true",
    "DYN_CANARY_WAIT_TIME": "0.2",
    "SIDECAR_CANARY_RETRY_INTERVAL": "0.2",
    "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "0.5",
}
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy")
PROXY_VARIABLES += ("all_proxy",)
URL = "http://engine:8000"
REQUEST_HEAD = re.compile(
    rb"(GET|POST|HEAD|PUT|DELETE|PATCH|OPTIONS) (\S+) HTTP/1\.[01]\r\n(.*?)\r\n\r\n", re.S
)


class Listener:
    """A loopback TCP listener run by threads; counts the connections it accepts."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind((LOOPBACK, 0))
        self.sock.listen(64)
        self.sock.settimeout(0.1)
        self.port: int = self.sock.getsockname()[1]
        self.accepted = 0
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.open: list[socket.socket] = []
        self._spawn(self._accept_loop)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def _spawn(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self.threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            self.open.append(conn)
            self.handle(conn)

    def handle(self, conn: socket.socket) -> None:
        conn.close()

    def close(self) -> None:
        self.stopping.set()
        self.sock.close()
        for conn in self.open:
            with contextlib.suppress(OSError):
                conn.close()
        for thread in self.threads:
            thread.join(2)


class RecordingRelay(Listener):
    """Relays every connection to the engine and keeps what the client sent on each."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.sent: list[bytearray] = []
        super().__init__()

    def handle(self, conn: socket.socket) -> None:
        upstream = socket.create_connection((LOOPBACK, self.upstream_port), timeout=5)
        self.open.append(upstream)
        record = bytearray()
        self.sent.append(record)
        self._spawn(self._pump, conn, upstream, record)
        self._spawn(self._pump, upstream, conn, None)

    def _pump(self, src: socket.socket, dst: socket.socket, record: bytearray | None) -> None:
        src.settimeout(0.2)
        while not self.stopping.is_set():
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            if record is not None and len(record) < 1_000_000:
                record.extend(data)
            try:
                dst.sendall(data)
            except OSError:
                break
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def requests(self) -> list[tuple[str, str, dict[str, str]]]:
        """(method, path, headers) of every request head the sidecar sent through the relay."""
        found = []
        for record in list(self.sent):
            for method, path, head in REQUEST_HEAD.findall(bytes(record)):
                headers = {}
                for line in head.decode("latin-1").split("\r\n"):
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
                found.append((method.decode(), path.decode(), headers))
        return found


@pytest.fixture
def listeners() -> Iterator[list[Listener]]:
    started: list[Listener] = []
    yield started
    for listener in started:
        listener.close()


def _address(hex_address: str) -> tuple[str, int]:
    host, port = hex_address.split(":")
    if len(host) == 8:
        ip = socket.inet_ntop(socket.AF_INET, bytes.fromhex(host)[::-1])
    else:
        words = [bytes.fromhex(host[i : i + 8])[::-1] for i in range(0, 32, 8)]
        ip = socket.inet_ntop(socket.AF_INET6, b"".join(words))
    return ip, int(port, 16)


def tcp_peers(pid: int) -> list[tuple[tuple[str, int], tuple[str, int], str]]:
    """(local, remote, state) of every TCP socket the process holds."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):
            found = re.fullmatch(r"socket:\[(\d+)\]", str(fd.readlink()))
            if found:
                inodes.add(found[1])
    peers = []
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                peers.append((_address(fields[1]), _address(fields[2]), fields[3]))
    return peers


def canaries_at(fake: Any) -> list[dict[str, Any]]:
    return [r for r in fake.requests() if r["path"] == "/v1/completions"]


async def canaries_of(engine: ProcessLink) -> list[dict[str, Any]]:
    return [r for r in await engine.requests() if r["path"] == "/v1/completions"]


async def last_canary(side: InProcessSidecar) -> dict[str, Any] | None:
    _, body = await side.health_body()
    return body["checks"]["generate"]["last_canary"]  # type: ignore[no-any-return]


# --- the sidecar sends requests only to SIDECAR_ENGINE_URL ---------------------------------------


@pytest.mark.process
def test_requests_go_only_to_the_engine_url_whatever_the_proxy_variables(
    engine, sidecar, listeners
) -> None:
    fake = engine("vllm")
    trap = Listener()
    relay = RecordingRelay(fake.port)
    listeners.extend([trap, relay])
    proxies = dict.fromkeys(PROXY_VARIABLES, trap.url)
    env = CANARY_ON | proxies | {"NO_PROXY": "", "no_proxy": "", "SIDECAR_ENGINE_URL": relay.url}
    side = sidecar(env)
    side.wait_status(200, 5)

    # Watch the sidecar's own sockets while canaries, registrations and probes run.
    outbound: set[tuple[str, int]] = set()
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        for local, remote, state in tcp_peers(side.proc.pid):
            if state == "0A" or local[1] == side.port:
                continue  # its listening socket, and connections to it
            outbound.add(remote)
        side.get("/health")
        time.sleep(0.02)
    wait_until(lambda: len(canaries_at(fake)) >= 3, 3, what="three canaries")

    assert trap.accepted == 0, "the sidecar used a proxy from the environment"
    assert outbound <= {(LOOPBACK, relay.port)}, outbound
    assert relay.accepted >= 1
    sent = relay.requests()
    assert {(m, p) for m, p, _ in sent} >= {("GET", "/health"), ("POST", "/v1/completions")}
    hosts = {h.get("host") for _, _, h in sent}
    assert hosts == {f"{LOOPBACK}:{relay.port}"}, hosts
    # Everything the engine saw came through the relay, none around it.
    assert len(canaries_at(fake)) <= sum(1 for m, p, _ in sent if p == "/v1/completions")


# --- the engine API key is sent to the engine and shown nowhere ----------------------------------


def distinctive_key() -> tuple[str, str]:
    """A key, and the part of it that must never appear anywhere (no false match possible)."""
    needle = uuid.uuid4().hex
    return f"sk-hs-{needle}", needle


EXPOSED = ("/health", "/live", "/metrics", "/openapi.json", "/nope")


def exposed(side: Sidecar) -> dict[str, str]:
    """Everything the sidecar serves, as text: bodies and headers, GET and HEAD."""
    seen = {}
    for path in EXPOSED:
        for method in ("GET", "HEAD"):
            answer = side.http.request(method, f"{side.url}{path}")
            seen[f"{method} {path}"] = answer.text + repr(dict(answer.headers))
    return seen


async def exposed_in_process(side: InProcessSidecar) -> dict[str, str]:
    """Everything the in-process sidecar's app serves, as text: bodies and headers, GET and
    HEAD."""
    seen = {}
    for path in EXPOSED:
        for method in ("GET", "HEAD"):
            answer = await side.http.request(method, path)
            seen[f"{method} {path}"] = answer.text + repr(dict(answer.headers))
    return seen


def logged_as_the_command_line_logs(caplog: pytest.LogCaptureFixture) -> None:
    """Every record at DEBUG, httpx's and httpcore's from WARNING (sidecar/tools/cli.py)."""
    for name in ("httpx", "httpcore"):
        caplog.set_level(logging.WARNING, logger=name)
    caplog.set_level(logging.DEBUG)  # last: it sets the capturing handler's level too


@pytest.mark.unit
def test_api_key_is_every_requests_bearer_and_appears_in_nothing_served_or_logged(caplog) -> None:
    """Every request the sidecar sends carries the key as a bearer token; through the engine's
    rejection (401) and a hang long enough to fail liveness, no body, header or log line shows
    it."""
    key, needle = distinctive_key()
    logged_as_the_command_line_logs(caplog)
    env = CANARY_ON | {
        "SIDECAR_ENGINE_URL": URL,
        "SIDECAR_ENGINE_API_KEY": key,
        "SIDECAR_LOG_LEVEL": "DEBUG",
        "SIDECAR_LIVENESS_WINDOW": "0.5",  # let liveness fail too: its reason is served
    }
    seen: dict[str, str] = {}

    async def main() -> None:
        engine = ProcessLink("vllm")
        async with running(env, {URL: engine}) as side:
            await side.wait_status(200, 5)
            seen.update(await exposed_in_process(side))
            # Every request, canary or not, carries it as a bearer token.
            assert engine.sent
            bearers = {s.headers.get("authorization") for s in engine.sent}
            assert bearers == {f"Bearer {key}"}, bearers
            assert (await canaries_of(engine))[0]["headers"]["authorization"] == f"Bearer {key}"

            # The engine rejects the key, then hangs: every error path formats a reason.
            await engine.fault(
                generation_status=401, generation_error="Unauthorized: invalid API key"
            )
            await side.wait_status(503, 3)

            async def rejected() -> bool:
                return "Unauthorized" in (await side.health_body())[1]["reason"]

            await until(rejected, 3, what="the engine's rejection")
            seen.update({f"401 {k}": v for k, v in (await exposed_in_process(side)).items()})
            await engine.fault(generation_status=None, hang_generation=True)
            await side.wait_status(503, 3, path="/live")
            seen.update({f"hang {k}": v for k, v in (await exposed_in_process(side)).items()})
            await engine.fault(hang_generation=False)
            await side.wait_status(200, 3)
            seen["events"] = "\n".join(side.log)

    run_virtually(main)
    seen["log"] = caplog.text
    assert any(r.levelno == logging.DEBUG for r in caplog.records)  # DEBUG was really on
    leaked = [where for where, text in seen.items() if needle in text]
    assert not leaked, leaked


@pytest.mark.process
def test_api_key_reaches_the_engine_and_appears_nowhere_else(engine, sidecar, listeners) -> None:
    key, needle = distinctive_key()
    fake = engine("vllm")
    relay = RecordingRelay(fake.port)
    listeners.append(relay)
    env = CANARY_ON | {
        "SIDECAR_ENGINE_URL": relay.url,
        "SIDECAR_ENGINE_API_KEY": key,
        "SIDECAR_LOG_LEVEL": "DEBUG",
        "SIDECAR_LIVENESS_WINDOW": "0.5",  # let liveness fail too: its reason is served
    }
    side = sidecar(env)
    side.wait_status(200, 5)
    seen = exposed(side)

    # Every request, canary or not, carries it as a bearer token.
    sent = relay.requests()
    assert sent
    assert all(h.get("authorization") == f"Bearer {key}" for _, _, h in sent), sent
    assert canaries_at(fake)[0]["headers"]["authorization"] == f"Bearer {key}"

    # The engine rejects the key, then hangs: every error path formats a reason.
    fake.fault(generation_status=401, generation_error="Unauthorized: invalid API key")
    side.wait_status(503, 3)
    wait_until(
        lambda: "Unauthorized" in side.health()[1]["reason"], 3, what="the engine's rejection"
    )
    seen |= {f"401 {k}": v for k, v in exposed(side).items()}
    fake.fault(generation_status=None, hang_generation=True)
    side.wait_status(503, 3, path="/live")
    seen |= {f"hang {k}": v for k, v in exposed(side).items()}
    fake.fault(hang_generation=False)
    side.wait_status(200, 3)

    side.close()
    seen["log"] = side.proc.output()
    assert "DEBUG" in seen["log"]  # the log level that logs the most was really on
    leaked = [where for where, text in seen.items() if needle in text]
    assert not leaked, leaked


def environment(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """Exactly ``env`` of the variables the sidecar reads, as ``python -m sidecar`` would find
    them."""
    for field in Settings.model_fields.values():
        monkeypatch.delenv(str(field.validation_alias), raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.unit
def test_api_key_absent_from_check_config_and_config_errors(monkeypatch, capsys) -> None:
    """The command line, called in-process as ``python -m sidecar`` calls it."""
    key, needle = distinctive_key()

    def run(*args: str, **env: str) -> tuple[int, str, str]:
        environment(monkeypatch, {"SIDECAR_ENGINE_API_KEY": key} | env)
        code = cli.main(list(args))
        out = capsys.readouterr()
        return code, out.out, out.err

    outputs = {
        "check-config": run("--check-config"),
        "probes": run("probes"),
        "bad port": run("--check-config", DYN_SYSTEM_PORT="70000"),
        "bad everything": run(
            DYN_SYSTEM_PORT="x", SIDECAR_BACKEND="tgi", SIDECAR_ENGINE_URL="ftp://x"
        ),
    }
    assert outputs["check-config"][0] == 0, outputs["check-config"][2]
    assert "bearer token from SIDECAR_ENGINE_API_KEY" in outputs["check-config"][1]
    assert outputs["probes"][0] == 0, outputs["probes"][2]
    assert outputs["bad port"][0] == 2
    assert outputs["bad everything"][0] == 2
    assert len(outputs["bad everything"][2].splitlines()) == 3
    texts = {name: out + err for name, (_, out, err) in outputs.items()}
    leaked = [name for name, text in texts.items() if needle in text]
    assert not leaked, {name: texts[name] for name in leaked}


@pytest.mark.unit
def test_api_key_echoed_by_the_engine_is_not_served() -> None:
    key, needle = distinctive_key()
    env = CANARY_ON | {"SIDECAR_ENGINE_URL": URL, "SIDECAR_ENGINE_API_KEY": key}

    async def main() -> None:
        engine = ProcessLink("vllm")
        await engine.fault(generation_status=401, generation_error=f"invalid api key {key}")
        async with running(env, {URL: engine}) as side:
            await until(lambda: last_canary(side), 3, what="a canary")
            assert key in str(await engine.requests())  # the engine got it, as the bearer token
            assert needle not in (await side.get("/health")).text

    run_virtually(main)


@pytest.mark.unit
def test_credentials_echoed_by_a_gateway_are_not_served() -> None:
    """A gateway's error text quoting a URL with user:password or an Authorization header."""
    env = CANARY_ON | {"SIDECAR_ENGINE_URL": URL}

    async def main() -> None:
        engine = ProcessLink("vllm")
        await engine.fault(
            generation_status=502,
            generation_error="upstream http://svc:s3cr3t-pw@10.0.0.7/v1 said: "
            "Authorization: Bearer tok-xyz",
        )
        async with running(env, {URL: engine}) as side:
            await until(lambda: last_canary(side), 3, what="a canary")
            body = (await side.get("/health")).text
            assert "upstream http://<hidden>@10.0.0.7" in body  # the reason is still there
            for secret in ("s3cr3t-pw", "tok-xyz"):
                assert secret not in body
                assert secret not in (await side.get("/live")).text

    run_virtually(main)


@pytest.mark.unit
def test_api_key_with_a_control_character_is_not_served(monkeypatch, capsys, caplog) -> None:
    """Refused at start (exit 2: the fix this test asks for), or never shown."""
    key, needle = distinctive_key()
    env = CANARY_ON | {"SIDECAR_ENGINE_URL": URL, "SIDECAR_ENGINE_API_KEY": key + "\n"}
    environment(monkeypatch, env)
    refused = cli.main(["--check-config"]) == 2
    assert needle not in capsys.readouterr().err
    if refused:
        return
    caplog.set_level(logging.INFO)

    async def main() -> None:
        engine = ProcessLink("vllm")
        async with running(env, {URL: engine}) as side:

            async def registration_checked() -> bool:
                check = (await side.health_body())[1]["checks"]["generate"]
                return check["registration"] != "not checked yet"

            await until(registration_checked, 3, what="a registration check")
            assert needle not in (await side.get("/health")).text
            assert needle not in "\n".join(side.log)

    run_virtually(main)
    assert needle not in caplog.text


# --- nothing it serves changes its state ---------------------------------------------------------


def stable(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != "uptime"}


def state_metrics(text: str) -> str:
    """The metrics but the task gauge: a reading of the moment (a registration check in flight
    adds a task: measured 4 and 5 an instant apart), not state a request could change."""
    return "\n".join(
        line for line in text.splitlines() if not line.startswith("health_sidecar_asyncio_tasks ")
    )


def raw_exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection((LOOPBACK, port), timeout=2) as sock:
        sock.sendall(data)
        chunks = []
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := sock.recv(65536):
                chunks.append(chunk)
    return b"".join(chunks)


PATHS = ("/health", "/live", "/metrics", "/openapi.json", "/", "/health/", "/_debug")
METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE")
QUERIES = ("", "?ready=0&status=notready", "?" + "x" * 4000)


@pytest.mark.unit
def test_no_request_changes_the_state_or_reaches_the_engine() -> None:
    env = CANARY_ON | {"SIDECAR_ENGINE_URL": URL, "DYN_CANARY_WAIT_TIME": "3600"}

    async def main() -> None:
        engine = ProcessLink("vllm")
        async with running(env, {URL: engine}) as side:
            await side.wait_status(200, 5)

            async def state() -> tuple[Any, ...]:
                return (
                    stable((await side.health_body())[1]),
                    stable((await side.get("/live")).json()),
                    state_metrics(await side.metrics()),
                )

            def canaries_sent() -> int:
                return sum(s.path == "/v1/completions" for s in engine.sent)

            before = await state()
            sent_before = canaries_sent()
            for path in PATHS:
                for method in METHODS:
                    for query in QUERIES:
                        answer = await side.http.request(
                            method, f"{path}{query}", content=b'{"a": 1}'
                        )
                        assert answer.status_code < 500, (method, path, answer.status_code)
            answer = await side.http.post("/health", content=b"\x00" * 2_000_000)
            assert answer.status_code < 500
            answer = await side.http.request(
                "GET", "/health", headers={"content-type": "json"}, content=b"{"
            )
            assert answer.status_code < 500
            assert await state() == before
            assert canaries_sent() == sent_before  # probes never trigger a canary

    run_virtually(main)


@pytest.mark.unit
def test_every_route_answers_head() -> None:
    """HEAD answers as GET does, without a body (its removal is the HTTP server's: the process
    test below)."""

    async def main() -> None:
        engine = ProcessLink("vllm")
        async with running({"SIDECAR_ENGINE_URL": URL}, {URL: engine}) as side:
            await side.wait_status(200, 5)
            for path in ("/health", "/live", "/metrics"):
                head = await side.http.head(path)
                get = await side.get(path)
                assert head.status_code == 200, (path, head.status_code)
                assert head.headers["content-type"] == get.headers["content-type"], path

    run_virtually(main)


@pytest.mark.process
def test_what_is_not_a_request_the_app_sees_changes_nothing(engine, sidecar) -> None:
    """Bytes the HTTP server never hands to the app (not HTTP, a negative Content-Length, HTTP/9.9,
    a TLS ClientHello, a 70 kB request line) and a 2 MB body it must read past: no 5xx, no crash,
    the verdict unchanged, no canary; and HEAD answered without a body."""
    fake = engine("vllm")
    env = CANARY_ON | {"SIDECAR_ENGINE_URL": fake.url, "DYN_CANARY_WAIT_TIME": "3600"}
    side = sidecar(env)
    side.wait_status(200, 5)
    before = (
        stable(side.health()[1]),
        stable(side.get("/live").json()),
        state_metrics(side.metrics()),
    )
    sent_before = len(canaries_at(fake))

    assert side.http.post(f"{side.url}/health", content=b"\x00" * 2_000_000).status_code < 500
    for garbage in (
        b"GARBAGE\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
        b"GET /health HTTP/9.9\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,  # a TLS ClientHello
        b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n",
    ):
        reply = raw_exchange(side.port, garbage)
        assert not reply.startswith(b"HTTP/1.1 5"), (garbage[:30], reply[:80])
    for path in ("/health", "/live", "/metrics"):
        answer = side.http.head(f"{side.url}{path}")
        assert answer.status_code == 200, (path, answer.status_code)
        assert answer.content == b""

    assert side.proc.popen.poll() is None, side.proc.output()[-2000:]
    after = (
        stable(side.health()[1]),
        stable(side.get("/live").json()),
        state_metrics(side.metrics()),
    )
    assert after == before
    assert len(canaries_at(fake)) == sent_before  # probes never trigger a canary
