"""Coverage-guided fuzzing (atheris, on libFuzzer) of the parsers of untrusted input where coverage
guidance finds more than Hypothesis's properties (tests/test_fuzz.py): run by hand, outside the
test suite, for a bounded number of inputs.

    .venv/bin/python scripts/fuzz_atheris.py metrics -runs=100000
    .venv/bin/python scripts/fuzz_atheris.py judge -runs=100000
    .venv/bin/python scripts/fuzz_atheris.py grpc -runs=100000

Targets (every unit's plan of every transport, backend and role that gets a canary):

- ``metrics``: an engine's Prometheus or OpenMetrics text, built from the fuzzer's bytes as a
  sequence of tokens (the series names the plans read, their labels, numbers, punctuation) and
  raw text, through ``Exposition.parse`` and every reader of a metrics read: ``read_progress``,
  ``ranks_in``, ``read_transfers``, ``sleeping_in``, ``read_load``, and a Dynamo worker's
  ``instances_in_metrics`` with ``pick``;
- ``judge``: a canary's answer: a JSON value built from the bytes (the fields the probers read,
  any values), or the raw bytes, as an HTTP answer (200 and error statuses) judged by each HTTP
  plan, as a Dynamo worker's chunks judged by each Dynamo plan, and through ``error_text`` and
  ``parsed_answer``;
- ``grpc``: the bytes as messages of each gRPC plan's response type (the engines' stubs and the
  sidecar's own declarations), mapped as the channel maps them (``_as_dict``) and judged.

An input must end in a value, or in the parser's own error (``MetricsUnreadable``); any other
exception is a finding, and so is an input that takes over ``--slow`` seconds (0.5). Nothing
raises to libFuzzer: each finding is printed once, where it was raised, with the shortest input
that raised it, and the run ends with a summary, the known defects (the ``xfail`` properties of
tests/test_fuzz.py) named apart from new ones. libFuzzer's own options follow the target
(``-runs``, 100,000 by default; ``-max_len``, 4096; ``-len_control``, 10; ``-seed``); nothing is
written to disk.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

with atheris.instrument_imports(include=["sidecar", "prometheus_client"]):
    from google.protobuf import descriptor_pool, message_factory
    from google.protobuf.message import DecodeError, Message

    from sidecar.config import Settings
    from sidecar.core.evidence.lifecycle import sleeping_in
    from sidecar.core.evidence.load import read_load
    from sidecar.core.evidence.progress import (
        Exposition,
        MetricsUnreadable,
        Series,
        ranks_in,
        read_progress,
    )
    from sidecar.core.evidence.transfers import read_transfers
    from sidecar.core.vocabulary import Mode
    from sidecar.probes.base import CanaryPlan
    from sidecar.probes.exchange import Answer, Received, Streamed, error_text, parsed_answer
    from sidecar.probes.judge import judge
    from sidecar.runtime.grpcchannel import _as_dict
    from sidecar.transports import TRANSPORTS
    from sidecar.transports.dynamo.identity import IDENTITY_SERIES, instances_in_metrics, pick
    from sidecar.transports.grpc import service_names
    from sidecar.transports.grpc.base import GrpcProber
    from sidecar.transports.grpc.sglang_native_pb import DECLARED as SGLANG_NATIVE
    from sidecar.transports.openengine.messages import DECLARED as OPENENGINE
    from sidecar.wiring import check, resolve


def engine_url(transport: Any) -> str:
    """An engine URL of the kind the transport takes (its seam says grpc:// or http(s)://)."""
    return "grpc://127.0.0.1:50051" if transport.grpc_url else "http://127.0.0.1:8000"


PAYLOAD = '{"prompt": "x", "max_tokens": 1}'


def _plans() -> list[CanaryPlan]:
    """Every transport, backend and role that gets a canary (built-in, or a user's payload)."""
    plans = []
    for name, transport in TRANSPORTS.items():
        for backend in transport.backends:
            services = service_names(backend) if name == "grpc" else (None,)
            for mode in Mode:
                for service in services:
                    for payload in (None, PAYLOAD):
                        env = {
                            "SIDECAR_BACKEND": backend,
                            "SIDECAR_DISAGGREGATION_MODE": mode.value,
                            "SIDECAR_TRANSPORT": name,
                            "SIDECAR_ENGINE_URL": engine_url(transport),
                            "DYN_HEALTH_CHECK_ENABLED": "true",
                        }
                        if mode is Mode.ENCODE:
                            env["SIDECAR_MODEL_TYPE"] = "multimodal"
                            if name == "dynamo":
                                env["DYN_VLLM_EMBEDDING_TRANSFER_MODE"] = "local"
                        if service is not None:
                            env["SIDECAR_GRPC_SERVICE"] = service
                        if payload is not None:
                            env["DYN_HEALTH_CHECK_PAYLOAD"] = payload
                        settings = Settings.model_validate(env)
                        assert not check(settings), check(settings)
                        plan = resolve(settings).plan
                        if plan.enabled:
                            plans.append(plan)
    return plans


PLANS = _plans()
UNITS = PLANS + [p.for_rank(1) for p in PLANS if p.reads.pin is not None]
HTTP = [p for p in PLANS if p.prober.transport == "http"]
DYNAMO = [p for p in PLANS if p.prober.transport == "dynamo"]
GRPC = [p for p in PLANS if p.prober.transport in ("grpc", "openengine")]


def _series(plan: CanaryPlan) -> tuple[Series, ...]:
    transfers = plan.transfers.every() if plan.transfers is not None else ()
    load = plan.reads.load.every() if plan.reads.load is not None else ()
    return (*plan.progress_spec().every(), *transfers, *plan.awake, *load)


# --- findings -------------------------------------------------------------------------------

#: Known defects, each an xfail property of tests/test_fuzz.py: (exception, where) -> the test.
KNOWN = {
    ("RecursionError", "json"): "test_deeply_nested_json_from_the_engine_ends_in_a_verdict",
    ("ValueError", "ranks_in"): "test_a_rank_label_that_is_no_ascii_number_ends_in_a_count",
    ("SerializeToJsonError", "_as_dict"): "test_a_grpc_map_key_that_is_no_utf8_ends_in_a_verdict",
}


@dataclass
class Finding:
    kind: str
    where: str
    count: int = 0
    shortest: str = ""
    trace: list[str] = field(default_factory=list)

    def known(self) -> str | None:
        for (kind, marker), test in KNOWN.items():
            if kind == self.kind and any(marker in line for line in self.trace):
                return test
        return None


@dataclass
class Run:
    target: str
    runs: int
    slow: float
    done: int = 0
    started: float = field(default_factory=time.monotonic)
    findings: dict[tuple[str, str], Finding] = field(default_factory=dict)
    slowest: tuple[float, str] = (0.0, "")

    def found(self, kind: str, where: str, shown: str, trace: list[str]) -> None:
        key = (kind, where)
        finding = self.findings.get(key)
        if finding is None:
            finding = self.findings[key] = Finding(kind, where, trace=trace)
            print(f"\n[new finding] {kind} at {where}: {shown[:300]}", flush=True)
        finding.count += 1
        if not finding.shortest or len(shown) < len(finding.shortest):
            finding.shortest = shown

    def summary(self) -> None:
        took = time.monotonic() - self.started
        print(f"\n=== {self.target}: {self.done} inputs in {took:.0f} s", flush=True)
        print(f"slowest input: {self.slowest[0] * 1000:.1f} ms: {self.slowest[1][:200]}")
        if not self.findings:
            print("no finding: every input ended in a value or the parser's own error")
        for finding in sorted(self.findings.values(), key=lambda f: -f.count):
            test = finding.known()
            label = f"known (tests/test_fuzz.py::{test})" if test else "NEW"
            print(f"- {label}: {finding.kind} at {finding.where}, {finding.count} input(s)")
            print(f"  shortest input: {finding.shortest[:300]}")
            if not test:
                print("  " + "  ".join(finding.trace[-6:]))


RUN: Run


def _where(exc: BaseException) -> tuple[str, list[str]]:
    """The innermost frame in the sidecar's code (else the innermost), and the stack."""
    frames = traceback.extract_tb(exc.__traceback__)
    trace = [
        f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno} {f.name}\n"
        for f in frames
    ]
    ours = [f for f in frames if "/sidecar/" in f.filename]
    frame = (ours or frames)[-1]
    return f"{Path(frame.filename).name}:{frame.lineno} {frame.name}", trace


def guarded(check_one: Callable[[atheris.FuzzedDataProvider], str]) -> Callable[[bytes], None]:
    """libFuzzer's entry: one input, its findings noted, nothing raised."""

    def one(data: bytes) -> None:
        fdp = atheris.FuzzedDataProvider(data)
        shown = repr(data)
        started = time.perf_counter()
        try:
            shown = check_one(fdp)
        except Exception as exc:
            where, trace = _where(exc)
            RUN.found(type(exc).__name__, where, shown, trace)
        took = time.perf_counter() - started
        if took > RUN.slowest[0]:
            RUN.slowest = (took, shown)
        if took > RUN.slow:
            RUN.found("slow", f"over {RUN.slow:g} s", f"{took:.2f} s: {shown}", [])
        RUN.done += 1
        if RUN.done == RUN.runs:
            RUN.summary()

    return one


# --- the metrics --------------------------------------------------------------------------------

_NAMES = sorted({s.name for p in UNITS for s in _series(p)} | {s.name for s in IDENTITY_SERIES})
_LABELS = sorted(
    {k for p in UNITS for s in _series(p) for k, _ in s.labels}
    | {"engine", "dp_rank", "worker_id", "dynamo_namespace", "dynamo_component", "dynamo_endpoint"}
)
_VALUES = sorted({v for p in UNITS for s in _series(p) for _, v in s.labels})
METRIC_TOKENS = (
    [f"\n{n}" for n in _NAMES]
    + [f"{n}_total" for n in _NAMES]
    + [f'{k}="' for k in _LABELS]
    + _VALUES
    + ["{", "}", '"', ",", "=", " ", "\n", "\\", '\\"', "\\n", "#", "# TYPE ", "# HELP ", "# EOF"]
    + [" gauge", " counter", " histogram", " 1", " 0", " NaN", " +Inf", " -1", " 1e308", " 17e9"]
    + ["0", "1", "2", "ff", "generate", "dynamo", "backend"]
)


def metrics_text(fdp: atheris.FuzzedDataProvider) -> str:
    parts = []
    while fdp.remaining_bytes():
        token = fdp.ConsumeIntInRange(0, len(METRIC_TOKENS))
        if token == len(METRIC_TOKENS):
            parts.append(fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 12)))
        else:
            parts.append(METRIC_TOKENS[token])
    return "".join(parts)


def check_metrics(fdp: atheris.FuzzedDataProvider) -> str:
    plan = UNITS[fdp.ConsumeIntInRange(0, len(UNITS) - 1)]
    text = metrics_text(fdp)
    shown = repr(text)
    spec = plan.progress_spec()
    try:
        parsed = Exposition.parse(text, {s.name for s in _series(plan)})
    except MetricsUnreadable:
        return shown
    read_progress(parsed, spec, 1.0, 2.0)
    if plan.transfers is not None:
        read_transfers(parsed, plan.transfers, 1.0, 2.0)
    if plan.awake:
        sleeping_in(parsed, plan.awake)
    if plan.reads.load is not None:
        read_load(parsed, plan.reads.load, 1.0)
    if plan.reads.pin is not None:
        ranks = ranks_in(parsed, (*spec.running, *spec.waiting), plan.reads.pin.label)
        if len(set(ranks)) != len(ranks):
            raise AssertionError(f"ranks_in counted a rank twice: {ranks}")
    try:
        found = instances_in_metrics(text, "generate")
    except MetricsUnreadable:
        return shown
    pick(found, "generate", "GET /metrics")
    return shown


# --- the JSON judgement -------------------------------------------------------------------------

JSON_KEYS = [
    "choices", "text", "token_ids", "finish_reason", "usage", "completion_tokens", "error",
    "message", "detail", "meta_info", "type", "ec_transfer_params", "item_indices",
    "completion_usage", "multimodal_inputs", "embeddings_shape", "serialized_request",
]  # fmt: skip
JSON_WORDS = [
    "length",
    "stop",
    "abort",
    "",
    '{"type": "length"}',
    "encoder_cache.a1_2.x.safetensors",
]


def json_value(fdp: atheris.FuzzedDataProvider, depth: int = 0) -> Any:
    kind = fdp.ConsumeIntInRange(0, 9 if depth < 6 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return fdp.ConsumeBool()
    if kind == 2:
        return fdp.ConsumeIntInRange(-2, 5)
    if kind == 3:
        return fdp.ConsumeInt(8)
    if kind == 4:
        return fdp.ConsumeRegularFloat() if fdp.ConsumeBool() else fdp.ConsumeFloat()
    if kind == 5:
        if fdp.ConsumeBool():
            return JSON_WORDS[fdp.ConsumeIntInRange(0, len(JSON_WORDS) - 1)]
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 10))
    if kind in (6, 7):
        return [json_value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 3))]
    keys = [
        JSON_KEYS[fdp.ConsumeIntInRange(0, len(JSON_KEYS) - 1)]
        if fdp.ConsumeBool()
        else fdp.ConsumeUnicodeNoSurrogates(4)
        for _ in range(fdp.ConsumeIntInRange(0, 4))
    ]
    return {key: json_value(fdp, depth + 1) for key in keys}


def check_judge(fdp: atheris.FuzzedDataProvider) -> str:
    http = HTTP[fdp.ConsumeIntInRange(0, len(HTTP) - 1)]
    dynamo = DYNAMO[fdp.ConsumeIntInRange(0, len(DYNAMO) - 1)]
    status = (200, 200, 200, 500, 404)[fdp.ConsumeIntInRange(0, 4)]
    if fdp.ConsumeIntInRange(0, 3) == 0:
        value, body = None, fdp.ConsumeBytes(fdp.remaining_bytes())
    else:
        value = json_value(fdp)
        body = json.dumps(value).encode()
    shown = repr(body)
    for plan in (http,):
        request = plan.request("model", "canary-fuzz")
        answer = Answer(status, "application/json", body)
        result = judge(plan, request, Received(answer, 0.0, 0.1, 0.0))
        plan.leftovers(request, parsed_answer(answer))
        if not result.reason or ("\n" in result.reason and status != 200):
            raise AssertionError(f"reason {result.reason!r}")
    error_text(body)
    if value is not None:
        chunks = tuple(value) if isinstance(value, list) else (value,)
        request = dynamo.request("model", "canary-fuzz")
        judge(dynamo, request, Received(Streamed(chunks), 0.0, 0.1, 0.0))
        dynamo.leftovers(request, parsed_answer(Streamed(chunks)))
    return shown


# --- gRPC messages ------------------------------------------------------------------------------


def _responses() -> list[type[Message]]:
    OPENENGINE.register()
    SGLANG_NATIVE.register()
    kinds = []
    for plan in GRPC:
        if isinstance(plan.prober, GrpcProber):
            type(plan.prober).messages()
        path = plan.path.removeprefix("/").replace("/", ".")
        method = descriptor_pool.Default().FindMethodByName(path)
        kinds.append(message_factory.GetMessageClass(method.output_type))
    return kinds


RESPONSES = _responses()


def check_grpc(fdp: atheris.FuzzedDataProvider) -> str:
    index = fdp.ConsumeIntInRange(0, len(GRPC) - 1)
    plan, kind = GRPC[index], RESPONSES[index]
    messages = []
    wire = []
    while fdp.remaining_bytes():
        data = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))
        wire.append(data)
        try:
            message = kind.FromString(data)
        except DecodeError:
            continue
        messages.append(_as_dict(message))
    shown = f"{kind.DESCRIPTOR.full_name} {wire!r}"
    request = plan.request("model", "canary-fuzz")
    judge(plan, request, Received(Streamed(tuple(messages)), 0.0, 0.1, 0.0))
    return shown


TARGETS = {"metrics": check_metrics, "judge": check_judge, "grpc": check_grpc}


def main() -> None:
    global RUN
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        print(__doc__)
        sys.exit(2)
    target, args = sys.argv[1], [sys.argv[0], *sys.argv[2:]]
    runs = next((int(a.split("=", 1)[1]) for a in args if a.startswith("-runs=")), 100_000)
    slow = next((float(a.split("=", 1)[1]) for a in args if a.startswith("--slow=")), 0.5)
    args = [a for a in args if not a.startswith("--slow=")]
    for option, default in (("-runs=", runs), ("-max_len=", 4096), ("-len_control=", 10)):
        if not any(a.startswith(option) for a in args):
            args.append(f"{option}{default}")
    RUN = Run(target, runs, slow)
    print(f"{target}: {len(PLANS)} plans, {len(UNITS)} units, {runs} inputs", flush=True)
    atheris.Setup(args, guarded(TARGETS[target]))
    atheris.Fuzz()


if __name__ == "__main__":
    main()
