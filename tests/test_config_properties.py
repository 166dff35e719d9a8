"""Configuration parsing as properties: every malformed value of every variable stops the sidecar
with one line that names the variable (never a traceback, never a silent default), and every
valid value is taken as given.

Variables are not listed here by hand: every field of ``sidecar.config.Settings`` is found and
given strategies by its kind (its type and constraints, or, for the few free-form ones, its
name). A new variable without a strategy fails ``test_every_variable_has_strategies``.

An empty value counts as unset (documented), so no strategy produces "". Environment values
cannot hold NUL or lone surrogates, so no strategy produces them either.

A few classes of malformed values were found by hand, each once a bug (accepted, then a traceback
or a leak at run time); they have their own tests at the end, named after what they guard.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar import wiring
from sidecar.config import ConfigError, LogLevel, Settings
from sidecar.config.values import MODE_ALIASES
from sidecar.core.vocabulary import MONITORED_ENDPOINTS, Mode
from sidecar.engines import ENGINES
from sidecar.transports import TRANSPORTS
from tests.support.configured import run_cli
from tests.support.harness import LOOPBACK, free_port

PROPERTY = settings(
    max_examples=50,
    deadline=None,
    database=None,  # nothing written into the work tree
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
ENV_PREFIXES = ("DYN_", "SIDECAR_")
BOOL_WORDS = {"0", "off", "f", "false", "n", "no", "1", "on", "t", "true", "y", "yes"}
SAFE_NAME = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=12)
# Anything an environment value can hold (no NUL, no lone surrogate), never empty.
ANY_TEXT = st.text(
    alphabet=st.characters(exclude_categories=("Cs",), exclude_characters="\x00"),
    min_size=1,
    max_size=40,
)
# Scratch files for DYN_HEALTH_CHECK_PAYLOAD=@path: a directory of pytest's (the fixture below),
# set before any strategy that names it is built or drawn.
SCRATCH = Path("/nonexistent")


@pytest.fixture(scope="module", autouse=True)
def _scratch(tmp_path_factory: pytest.TempPathFactory) -> None:
    global SCRATCH
    SCRATCH = tmp_path_factory.mktemp("config-properties")


def env_names() -> list[str]:
    return [str(field.validation_alias) for field in Settings.model_fields.values()]


def field_of(name: str) -> tuple[str, Any]:
    for key, field in Settings.model_fields.items():
        if field.validation_alias == name:
            return key, field
    raise KeyError(name)


def load(monkeypatch: pytest.MonkeyPatch, **env: str) -> Settings:
    """The full loader (sidecar.wiring.load, as the command line runs it) with exactly these
    variables set (all other DYN_/SIDECAR_ ones unset)."""
    for key in list(os.environ):
        if key.startswith(ENV_PREFIXES):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return wiring.load()


def assert_one_line_naming(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> str:
    """The property: ConfigError with exactly one line, starting with NAME=, and nothing else."""
    try:
        load(monkeypatch, **{name: value})
    except ConfigError as exc:
        lines = exc.lines
    else:
        pytest.fail(f"{name}={value!r} was accepted (a silent misconfiguration)")
    assert len(lines) == 1, lines
    line = lines[0]
    assert len(line.splitlines()) == 1, f"the error spans several lines: {line!r}"
    assert line.startswith(f"{name}="), line
    assert ": expected " in line, line
    return line


# --- strategies by kind --------------------------------------------------------------------------


def _bounds(field: Any) -> tuple[float, float]:
    """(lowest, highest) bound of a numeric field, from its constraints (gt/ge, lt/le)."""
    found: dict[str, float] = {}
    for meta in field.metadata:
        for attr in ("gt", "ge", "lt", "le"):
            if getattr(meta, attr, None) is not None:
                found[attr] = float(getattr(meta, attr))
    low = found.get("gt", found.get("ge"))
    high = found.get("lt", found.get("le"))
    assert low is not None, field
    assert high is not None, field
    return low, high


def _number_like(text: str) -> float | None:
    """What a lenient number parser could make of the text (None: not a number at all)."""
    try:
        return float(text.strip().replace("_", ""))
    except ValueError:
        return None


def _not_a_number(text: str) -> bool:
    return _number_like(text) is None


def _fmt(number: float) -> str:
    return repr(number) if isinstance(number, float) else str(number)


def seconds_strategies(field: Any) -> tuple[st.SearchStrategy[str], st.SearchStrategy[str]]:
    low, high = _bounds(field)
    malformed = st.one_of(
        ANY_TEXT.filter(_not_a_number),
        st.floats(max_value=low).map(_fmt),  # zero, negative, -inf
        st.floats(min_value=high, exclude_min=True).map(_fmt),  # too long, inf
        st.sampled_from(["nan", "NaN", "inf", "-inf", "Infinity", "-0", "0", "0.0"]),
        st.integers(min_value=int(high) + 1).map(str),
        st.integers(max_value=int(low)).map(str),
    )
    valid = st.one_of(
        st.floats(min_value=low, max_value=high, exclude_min=True).map(_fmt),
        st.integers(min_value=int(low) + 1, max_value=int(high)).map(str),
        st.sampled_from(["0.01", "0.5", "1", "2.5", "86400"]),
    )
    return malformed, valid


def integer_strategies(field: Any) -> tuple[st.SearchStrategy[str], st.SearchStrategy[str]]:
    low, high = _bounds(field)
    lo, hi = int(low), int(high)
    malformed = st.one_of(
        ANY_TEXT.filter(_not_a_number),
        st.integers(max_value=lo - 1).map(str),
        st.integers(min_value=hi + 1).map(str),
        st.floats(min_value=lo, max_value=hi)
        .filter(lambda x: not float(x).is_integer())
        .map(_fmt),  # a fraction
        st.sampled_from(["nan", "inf", "-inf", "1e400"]),
    )
    valid = st.integers(min_value=lo, max_value=hi).map(str)
    return malformed, valid


def bool_strategies() -> tuple[st.SearchStrategy[str], st.SearchStrategy[str]]:
    malformed = ANY_TEXT.filter(lambda v: v.lower() not in BOOL_WORDS)
    valid = st.sampled_from(sorted(BOOL_WORDS)).flatmap(
        lambda w: st.sampled_from([w, w.upper(), w.capitalize()])
    )
    return malformed, valid


def enum_values(enum: type[Enum]) -> set[str]:
    values = {str(member.value) for member in enum}
    if enum is Mode:
        values |= set(MODE_ALIASES)
    return values


def enum_strategies(enum: type[Enum]) -> tuple[st.SearchStrategy[str], st.SearchStrategy[str]]:
    return choice_strategies(enum_values(enum))


def choice_strategies(values: set[str]) -> tuple[st.SearchStrategy[str], st.SearchStrategy[str]]:
    """A variable that takes one of fixed names (an enum's values, a table's keys)."""
    near_misses = [v.upper() if v.islower() else v.lower() for v in values] + [
        v + " " for v in values
    ]
    malformed = st.one_of(
        ANY_TEXT.filter(lambda v: v not in values),
        st.sampled_from(sorted(v for v in near_misses if v not in values)),
    )
    return malformed, st.sampled_from(sorted(values))


def level_strategies(values: set[str]) -> tuple[st.SearchStrategy[str], st.SearchStrategy[str]]:
    """SIDECAR_LOG_LEVEL: its names in any case (the case is no near miss)."""
    malformed = st.one_of(
        ANY_TEXT.filter(lambda v: v.upper() not in values),
        st.sampled_from(sorted(v + " " for v in values)),
    )
    valid = st.sampled_from(sorted(values)).flatmap(
        lambda v: st.sampled_from([v, v.lower(), v.capitalize()])
    )
    return malformed, valid


SEGMENT = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~", min_size=1
)
GOOD_PATH = st.lists(SEGMENT, min_size=1, max_size=4).map(lambda parts: "/" + "/".join(parts))


def path_strategies(
    taken: set[str], unusable: set[str]
) -> tuple[st.SearchStrategy[str], st.SearchStrategy[str]]:
    """``taken``: paths rejected today as malformed; ``unusable``: paths no valid value takes."""
    malformed = st.one_of(
        ANY_TEXT.filter(lambda v: not v.startswith("/")),
        st.tuples(GOOD_PATH, st.sampled_from(list("?# \t\r\n")), SAFE_NAME).map("".join),
        st.tuples(GOOD_PATH, GOOD_PATH).map(lambda p: p[0] + "/" + p[1]),  # "//" inside
        *([st.sampled_from(sorted(taken))] if taken else []),
    )
    valid = st.one_of(st.just("/"), GOOD_PATH).filter(lambda p: p not in taken | unusable)
    return malformed, valid


JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.text(max_size=10)
JSON_VALUES = st.recursive(
    JSON_SCALARS | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=8,
)


def _not_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return True
    return False


def list_strategies() -> tuple[st.SearchStrategy[str], st.SearchStrategy[str]]:
    names = list(MONITORED_ENDPOINTS)
    malformed = st.one_of(
        ANY_TEXT.filter(_not_json),
        JSON_VALUES.filter(lambda v: not isinstance(v, list)).map(json.dumps),
        st.lists(JSON_VALUES, min_size=1, max_size=3)
        .filter(lambda v: not all(isinstance(x, str) for x in v))
        .map(json.dumps),
        st.lists(st.text(max_size=12).filter(lambda s: s not in names), min_size=1, max_size=3)
        .flatmap(lambda bad: st.permutations([*bad, *names[:1]]))
        .map(json.dumps),  # an endpoint the sidecar does not monitor
    )
    valid = st.lists(st.sampled_from(names), max_size=3).map(json.dumps)
    return malformed, valid


def _scratch_file(content: bytes) -> str:
    handle = tempfile.NamedTemporaryFile(dir=SCRATCH, suffix=".json", delete=False)  # noqa: SIM115
    with handle:
        handle.write(content)
    return "@" + handle.name


def payload_strategies() -> tuple[st.SearchStrategy[str], st.SearchStrategy[str]]:
    not_objects = JSON_VALUES.filter(lambda v: not isinstance(v, dict)).map(json.dumps)
    malformed = st.one_of(
        ANY_TEXT.filter(lambda v: not v.startswith("@") and _not_json(v)),
        not_objects,
        SAFE_NAME.map(lambda n: f"@{SCRATCH}/missing-{n}.json"),  # no such file
        st.just(f"@{SCRATCH}"),  # a directory
        ANY_TEXT.filter(_not_json).map(lambda t: _scratch_file(t.encode())),
        not_objects.map(lambda t: _scratch_file(t.encode())),
        st.binary(min_size=1, max_size=8).map(lambda b: _scratch_file(b'{"a": "' + b"\xff" + b)),
    )
    objects = st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=4)
    valid = st.one_of(
        objects.map(json.dumps), objects.map(lambda o: _scratch_file(json.dumps(o).encode()))
    )
    return malformed, valid


HOST_LABEL = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?", fullmatch=True)
HOST_NAME = st.lists(HOST_LABEL, min_size=1, max_size=3).map(".".join)
IPV4 = st.tuples(*[st.integers(0, 255)] * 4).map(lambda t: ".".join(map(str, t)))
VALID_HOST = st.one_of(HOST_NAME, IPV4, st.sampled_from(["localhost", "0.0.0.0", "::1", "::"]))


def url_strategies() -> tuple[st.SearchStrategy[str], st.SearchStrategy[str]]:
    host = st.one_of(HOST_NAME.filter(lambda h: not h.isdigit()), IPV4)
    port = st.integers(1, 65535)
    malformed = st.one_of(
        st.builds(
            "{}://{}:{}".format, st.sampled_from(["ftp", "ws", "file", "tcp", ""]), host, port
        ),
        st.builds("{}:{}".format, host, port),  # no scheme
        st.sampled_from(["http://", "https://", "http:///v1", "http://:8000", "http://:0"]),
        st.builds("http://{}:{}/?{}=1".format, host, port, SAFE_NAME),  # a query
        st.builds("http://{}:{}#{}".format, host, port, SAFE_NAME),  # a fragment
        st.builds("http://{}:{}@{}:{}".format, SAFE_NAME, SAFE_NAME, host, port),  # credentials
        st.builds("http://{}:0".format, host),
        st.builds("http://{}:{}".format, host, st.integers(min_value=65536)),
        st.builds("http://{}:{}".format, host, SAFE_NAME.filter(lambda p: not p.isdigit())),
        ANY_TEXT.filter(lambda v: "://" not in v),
    )
    valid = st.builds(
        "{}://{}{}{}".format,
        st.sampled_from(["http", "https"]),
        st.one_of(HOST_NAME, IPV4, st.just("[::1]")),
        st.one_of(st.just(""), port.map(":{}".format)),
        st.one_of(st.just(""), st.just("/"), GOOD_PATH),
    )
    return malformed, valid


def grpc_target_strategies() -> tuple[st.SearchStrategy[str], st.SearchStrategy[str]]:
    """SIDECAR_REGISTRATION: grpc://HOST:PORT[/SERVICE]."""
    host = st.one_of(HOST_NAME.filter(lambda h: not h.isdigit()), IPV4)
    port = st.integers(1, 65535)
    service = st.from_regex(r"[A-Za-z0-9_.-]{0,40}", fullmatch=True)
    malformed = st.one_of(
        st.builds("{}://{}:{}".format, st.sampled_from(["http", "https", "tcp", ""]), host, port),
        st.builds("grpc://{}".format, host),  # no port
        st.builds("grpc://{}:0".format, host),
        st.builds("grpc://{}:{}".format, host, st.integers(min_value=65536)),
        st.builds("grpc://{}:{}/{} x".format, host, port, SAFE_NAME),  # not a service name
        st.builds("grpc://{}:{}?{}=1".format, host, port, SAFE_NAME),  # a query
        st.builds("grpc://{}@{}:{}".format, SAFE_NAME, host, port),  # credentials
        st.sampled_from(["grpc://", "grpc://:50051", "grpc:///x"]),
        ANY_TEXT.filter(lambda v: "://" not in v),
    )
    valid = st.builds(
        "grpc://{}:{}{}".format,
        st.one_of(HOST_NAME, IPV4, st.just("[::1]")),
        port,
        st.one_of(st.just(""), service.map("/{}".format)),
    )
    return malformed, valid


@dataclass(frozen=True)
class Kind:
    """How to make malformed and valid values of one variable, and what a valid one parses to."""

    malformed: st.SearchStrategy[str] | None  # None: no value is malformed (see ``why``)
    valid: st.SearchStrategy[str]
    parsed: Callable[[str], Any] | None = None  # what wiring.load() must make of a valid value
    why: str = ""


def _payload(value: str) -> Any:
    return json.loads(Path(value[1:]).read_text() if value.startswith("@") else value)


def _secret(value: Any) -> Any:
    return value.get_secret_value() if value is not None else None


# The gRPC transport, with its engine URL (SIDECAR_TRANSPORT=grpc needs a grpc:// one).
GRPC_ENGINE = {"SIDECAR_TRANSPORT": "grpc", "SIDECAR_ENGINE_URL": "grpc://127.0.0.1:50051"}


def transport_needs(name: str) -> dict[str, str]:
    """What a transport needs beside it: a grpc:// engine URL where it takes one, a backend it
    reaches (SIDECAR_BACKEND's default where it can)."""
    transport = TRANSPORTS.get(name)
    if transport is None:
        return {}
    needs = {}
    if transport.grpc_url:
        needs["SIDECAR_ENGINE_URL"] = GRPC_ENGINE["SIDECAR_ENGINE_URL"]
    if "vllm" not in transport.backends:
        needs["SIDECAR_BACKEND"] = transport.backends[0]
    return needs


def kind_of(name: str) -> Kind | None:
    """The strategies for one environment variable, or None when it has none (a test fails)."""
    _key, field = field_of(name)
    args = [a for a in get_args(field.annotation) if a is not type(None)] or [field.annotation]
    base = args[0]
    if get_origin(base) is Annotated:  # a kind of value with its validators (UrlPath | None)
        base = get_args(base)[0]
    expected = str((field.json_schema_extra or {}).get("expected", ""))
    special: dict[str, Callable[[], Kind]] = {
        "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": lambda: Kind(
            *list_strategies(), parsed=lambda v: tuple(dict.fromkeys(json.loads(v)))
        ),
        "DYN_HEALTH_CHECK_PAYLOAD": lambda: Kind(*payload_strategies(), parsed=_payload),
        "SIDECAR_ENGINE_URL": lambda: Kind(*url_strategies(), parsed=lambda v: v.rstrip("/")),
        "SIDECAR_KV_PEER_URL": lambda: Kind(*url_strategies(), parsed=lambda v: v.rstrip("/")),
        "SIDECAR_METRICS_URL": lambda: Kind(*url_strategies(), parsed=lambda v: v.rstrip("/")),
        "SIDECAR_REGISTRATION": lambda: Kind(*grpc_target_strategies(), parsed=lambda v: v),
        "DYN_SYSTEM_HOST": lambda: Kind(
            None,
            VALID_HOST,
            parsed=lambda v: v,
            why="malformed hosts: test_malformed_host_is_rejected",
        ),
        "SIDECAR_ENGINE_API_KEY": lambda: Kind(
            None,
            st.from_regex(r"[A-Za-z0-9\-._~+/]+=*", fullmatch=True),
            why="keys that cannot be a header value: "
            "test_api_key_that_is_no_header_value_is_rejected",
        ),
        "SIDECAR_CONTROL_TOKEN": lambda: Kind(
            None,
            st.from_regex(r"[A-Za-z0-9\-._~+/]+=*", fullmatch=True),
            why="tokens that cannot be a header value, and a token without a port: "
            "test_control_token_is_a_header_value_and_needs_a_port",
        ),
        "SIDECAR_CONTROL_PORT": lambda: Kind(
            st.one_of(
                st.integers(max_value=0).map(str),
                st.integers(min_value=65536).map(str),
                st.just("9090"),  # DYN_SYSTEM_PORT's default: the pod network's port
                SAFE_NAME.filter(lambda v: not v.isdigit()),
            ),
            st.integers(1, 65535).filter(lambda p: p != 9090).map(str),
            parsed=int,
        ),
        "SIDECAR_GRPC_PORT": lambda: Kind(
            st.one_of(
                st.integers(max_value=0).map(str),
                st.integers(min_value=65536).map(str),
                st.just("9090"),  # DYN_SYSTEM_PORT's default: the HTTP server's port
                SAFE_NAME.filter(lambda v: not v.isdigit()),
            ),
            st.integers(1, 65535).filter(lambda p: p != 9090).map(str),
            parsed=int,
        ),
        "SIDECAR_DP_RANKS": lambda: Kind(
            st.one_of(
                st.integers(max_value=0).map(str),
                st.integers(min_value=1025).map(str),
                SAFE_NAME.filter(lambda v: not v.isdigit() and v != "auto"),
            ),
            st.one_of(st.integers(1, 1024).map(str), st.just("auto")),
            parsed=lambda v: v if v == "auto" else int(v),
        ),
        "DYN_FILE_KV": lambda: Kind(
            SAFE_NAME,  # relative: the worker's directory is named absolutely
            st.lists(SAFE_NAME, min_size=1, max_size=3).map(lambda p: "/" + "/".join(p)),
            parsed=lambda v: v,
        ),
        "SIDECAR_EC_STORAGE_PATH": lambda: Kind(
            SAFE_NAME,  # relative: the mount is named absolutely
            st.lists(SAFE_NAME, min_size=1, max_size=3).map(lambda p: "/" + "/".join(p)),
            parsed=lambda v: v,
        ),
        # Malformed: any value without SIDECAR_TRANSPORT=grpc (no service is called then).
        "SIDECAR_GRPC_SERVICE": lambda: Kind(
            ANY_TEXT.filter(bool),
            st.just("vllm.grpc.engine.VllmEngine"),
            parsed=lambda v: v,
        ),
        "SIDECAR_DYNAMO_ENDPOINT": lambda: Kind(
            st.one_of(
                st.lists(SAFE_NAME, min_size=2, max_size=2).map(".".join),
                st.lists(SAFE_NAME, min_size=4, max_size=5).map(".".join),
                SAFE_NAME.map(lambda v: v + "/x"),
            ),
            st.one_of(
                SAFE_NAME,
                st.lists(SAFE_NAME, min_size=3, max_size=3).map(".".join),
                st.lists(SAFE_NAME, min_size=3, max_size=3).map(lambda p: "dyn://" + ".".join(p)),
            ),
            parsed=lambda v: v.removeprefix("dyn://"),
        ),
        # A backend is a key of sidecar.engines.ENGINES, a transport one of TRANSPORTS.
        "SIDECAR_BACKEND": lambda: Kind(*choice_strategies(set(ENGINES)), parsed=lambda v: v),
        "SIDECAR_TRANSPORT": lambda: Kind(*choice_strategies(set(TRANSPORTS)), parsed=lambda v: v),
        "SIDECAR_LOG_LEVEL": lambda: Kind(
            *level_strategies(set(LogLevel)), parsed=lambda v: LogLevel(v.upper())
        ),
        "SIDECAR_MODEL": lambda: Kind(
            st.text(alphabet=" \t\n\r\x0b\x0c\u00a0\u2003\u3000", min_size=1),
            ANY_TEXT.filter(lambda v: v.strip() != ""),
            parsed=lambda v: v,
        ),
    }
    if name in special:
        return special[name]()
    if base is bool:
        return Kind(
            *bool_strategies(), parsed=lambda v: v.lower() in {"1", "on", "t", "true", "y", "yes"}
        )
    if isinstance(base, type) and issubclass(base, Enum):
        aliases = MODE_ALIASES if base is Mode else {}
        return Kind(*enum_strategies(base), parsed=lambda v: aliases.get(v, v))
    if base is float:
        return Kind(*seconds_strategies(field), parsed=float)
    if base is int:
        return Kind(*integer_strategies(field), parsed=int)
    if base is str and "URL path" in expected:
        # The sidecar's own routes: /metrics is taken; so is the other probe's default (a health
        # path on /live and /openapi.json have their own tests below).
        page_routes = {"/", "/debug/history"}  # the status page's routes
        taken, unusable = {
            "DYN_SYSTEM_HEALTH_PATH": ({"/metrics", *page_routes}, {"/live", "/openapi.json"}),
            "DYN_SYSTEM_LIVE_PATH": ({"/metrics", "/health", *page_routes}, {"/openapi.json"}),
        }.get(name, (set(), set()))
        return Kind(*path_strategies(taken, unusable), parsed=lambda v: v)
    return None


# --- the properties ------------------------------------------------------------------------------


@pytest.mark.unit
def test_every_variable_has_strategies() -> None:
    missing = [name for name in env_names() if kind_of(name) is None]
    assert not missing, f"no strategies for {missing}: add them to kind_of()"
    assert all(name.startswith(ENV_PREFIXES) for name in env_names())


@pytest.mark.unit
def test_variables_without_malformed_values_say_why() -> None:
    for name in env_names():
        kind = kind_of(name)
        assert kind is not None
        if kind.malformed is None:
            assert kind.why, name


def has_malformed_values(name: str) -> bool:
    kind = kind_of(name)
    return kind is None or kind.malformed is not None  # None: fails, naming the variable


@pytest.mark.unit
@pytest.mark.parametrize("name", [n for n in env_names() if has_malformed_values(n)])
@PROPERTY
@given(data=st.data())
def test_malformed_value_gives_one_line_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, name: str, data: st.DataObject
) -> None:
    kind = kind_of(name)
    assert kind is not None, f"no strategies for {name}"
    assert kind.malformed is not None
    value = data.draw(kind.malformed, label=name)
    line = assert_one_line_naming(monkeypatch, name, value)
    if name == "SIDECAR_ENGINE_API_KEY":
        assert value not in line


@pytest.mark.unit
@pytest.mark.parametrize("name", env_names())
@PROPERTY
@given(data=st.data())
def test_valid_value_is_taken_as_given(
    monkeypatch: pytest.MonkeyPatch, name: str, data: st.DataObject
) -> None:
    kind = kind_of(name)
    assert kind is not None
    value = data.draw(kind.valid, label=name)
    # The control token guards the control routes, which need their port; a minimum of ready
    # ranks needs as many ranks.
    needs = {
        "SIDECAR_CONTROL_TOKEN": {"SIDECAR_CONTROL_PORT": "9091"},
        "SIDECAR_DP_MIN_READY_RANKS": {"SIDECAR_DP_RANKS": "1024"},
        "SIDECAR_KV_PEER_URL": {"SIDECAR_DISAGGREGATION_MODE": "decode"},
        "SIDECAR_DYNAMO_ENDPOINT": {"SIDECAR_TRANSPORT": "dynamo"},
        "SIDECAR_METRICS_URL": GRPC_ENGINE,
        "SIDECAR_GRPC_SERVICE": GRPC_ENGINE,
        "SIDECAR_TRANSPORT": transport_needs(value),
        "SIDECAR_EC_STORAGE_PATH": {
            "SIDECAR_DISAGGREGATION_MODE": "encode",
            "SIDECAR_MODEL_TYPE": "multimodal",
        },
    }.get(name, {})
    loaded = load(monkeypatch, **{name: value}, **needs)
    key, _ = field_of(name)
    got = getattr(loaded, key)
    if key in ("engine_api_key", "control_token"):
        got = _secret(got)
        assert got == value
    elif kind.parsed is not None:
        want = kind.parsed(value)
        if isinstance(want, float):
            assert math.isclose(got, want), (value, got)
        else:
            assert got == want, (value, got)
    else:
        assert got is not None, value  # never a silent default


@pytest.mark.unit
def test_two_malformed_variables_give_two_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError) as info:
        load(monkeypatch, DYN_SYSTEM_PORT="0", SIDECAR_BACKEND="tgi")
    assert sorted(line.split("=")[0] for line in info.value.lines) == [
        "DYN_SYSTEM_PORT",
        "SIDECAR_BACKEND",
    ]


# --- the command line: exit 2, one line per variable, no traceback -------------------------------

# One malformed value per variable that has any; all at once, then a few one by one.
SAMPLE_MALFORMED: dict[str, str] = {
    "DYN_HEALTH_CHECK_ENABLED": "sometimes",
    "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": '["generate", "clear_kv_blocks"]',
    "DYN_SYSTEM_STARTING_HEALTH_STATUS": "healthy",
    "DYN_CANARY_WAIT_TIME": "nan",
    "DYN_HEALTH_CHECK_REQUEST_TIMEOUT": "-1",
    "DYN_HEALTH_CHECK_PAYLOAD": "[1, 2]",
    "DYN_SYSTEM_PORT": "70000",
    "DYN_SYSTEM_HEALTH_PATH": "health",
    "DYN_SYSTEM_LIVE_PATH": "/li ve",
    "SIDECAR_ENGINE_URL": "ftp://127.0.0.1:8000",
    "SIDECAR_BACKEND": "tgi",
    "SIDECAR_DISAGGREGATION_MODE": "decoder",
    "SIDECAR_MODEL_TYPE": "video",
    "SIDECAR_MODEL": "   ",
    "SIDECAR_FAILURE_THRESHOLD": "0",
    "SIDECAR_SUCCESS_THRESHOLD": "101",
    "SIDECAR_CANARY_RETRY_INTERVAL": "1s",
    "SIDECAR_LIVENESS_WINDOW": "86401",
    "SIDECAR_REGISTRATION_INTERVAL": "0",
    "SIDECAR_REGISTRATION_PATH": "health",
    "SIDECAR_CANARY_PATH": "/v1//completions",
    "SIDECAR_SGLANG_BOOTSTRAP_PORT": "8998.5",
    "SIDECAR_MAX_RESPONSE_BYTES": "1023",
    "SIDECAR_LOG_LEVEL": "verbose",
    "SIDECAR_CANARY_CHECK_ANSWER": "maybe",
    "SIDECAR_CONTROL_PORT": "0",
    "SIDECAR_MAINTENANCE_MAX": "0",
    "SIDECAR_DP_RANKS": "0",
    "SIDECAR_DP_MIN_READY_RANKS": "0",
    "SIDECAR_KV_PEER_URL": "tcp://127.0.0.1:8000",
    "SIDECAR_KV_PROBE_INTERVAL": "0",
    "SIDECAR_KV_PROBE_TIMEOUT": "-2",
    "SIDECAR_KV_PROBE_PROMPT_TOKENS": "8193",
}


def sample_for(name: str) -> str | None:
    """A malformed value for any variable: from the table, or by its kind (new variables)."""
    if name in SAMPLE_MALFORMED:
        return SAMPLE_MALFORMED[name]
    kind = kind_of(name)
    if kind is None or kind.malformed is None:
        return None
    _key, field = field_of(name)
    base = [a for a in get_args(field.annotation) if a is not type(None)] or [field.annotation]
    if get_origin(base[0]) is Annotated:
        base = [get_args(base[0])[0]]
    return {bool: "maybe", float: "0", int: "-1"}.get(base[0], "not a valid value")


PREFIX = "health-sidecar: configuration error: "


@pytest.mark.process
def test_every_malformed_variable_at_once_one_line_each() -> None:
    env = {name: value for name in env_names() if (value := sample_for(name)) is not None}
    # All but the host and the two tokens.
    assert len(env) >= len(env_names()) - 3
    done = run_cli("--check-config", env=env)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert all(line.startswith(PREFIX) for line in lines), lines
    named = sorted(line.removeprefix(PREFIX).split("=", 1)[0] for line in lines)
    assert named == sorted(env), named


@pytest.mark.process
@pytest.mark.parametrize(
    "name", ["DYN_SYSTEM_PORT", "DYN_HEALTH_CHECK_PAYLOAD", "SIDECAR_ENGINE_URL", "SIDECAR_MODEL"]
)
def test_malformed_value_exits_2_with_one_line_and_no_traceback(name: str) -> None:
    done = run_cli(env={name: SAMPLE_MALFORMED[name]})
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{PREFIX}{name}="), lines


# --- malformed values that once passed (each was a bug) -----------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(
    "name", ["DYN_HEALTH_CHECK_PAYLOAD", "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS"]
)
def test_deeply_nested_json_gives_one_line(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    assert_one_line_naming(monkeypatch, name, "[" * 100_000)


@pytest.mark.unit
@pytest.mark.parametrize(
    "value",
    ['{"prompt": "x", "temperature": NaN}', '{"max_tokens": Infinity}', '{"prompt": "\\ud800"}'],
)
def test_payload_that_cannot_be_sent_is_rejected(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    assert_one_line_naming(monkeypatch, "DYN_HEALTH_CHECK_PAYLOAD", value)


@pytest.mark.unit
@pytest.mark.parametrize("sep", ["\n", "\r", "\u2028"])
def test_payload_path_with_a_line_break_gives_one_line(
    monkeypatch: pytest.MonkeyPatch, sep: str
) -> None:
    assert_one_line_naming(monkeypatch, "DYN_HEALTH_CHECK_PAYLOAD", f"@{SCRATCH}/a{sep}b.json")


@pytest.mark.unit
@pytest.mark.parametrize("value", [" ", "bad host", "host/path", "http://0.0.0.0", "a\tb", "é!"])
def test_malformed_host_is_rejected(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    assert_one_line_naming(monkeypatch, "DYN_SYSTEM_HOST", value)


@pytest.mark.unit
@pytest.mark.parametrize("value", ["sk-abc\ndef", "sk-abc\r\nX-Injected: 1", "sk-\x7f", "ключ"])
def test_api_key_that_is_no_header_value_is_rejected(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    line = assert_one_line_naming(monkeypatch, "SIDECAR_ENGINE_API_KEY", value)
    assert value not in line


@pytest.mark.unit
@pytest.mark.parametrize("value", ["http://exa mple:8000", "http://h\\x:8000", "http://h\x0b:8000"])
def test_engine_url_with_a_malformed_host_is_rejected(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    assert_one_line_naming(monkeypatch, "SIDECAR_ENGINE_URL", value)


ENGINE_PATHS = [
    n
    for n in ("SIDECAR_REGISTRATION_PATH", "SIDECAR_CANARY_PATH", "SIDECAR_METRICS_PATH")
    if n in env_names()
]


@pytest.mark.unit
@pytest.mark.parametrize("name", ENGINE_PATHS)
@pytest.mark.parametrize("char", ["\x0b", "\x0c", "\x01", "\x7f"])
def test_engine_path_with_a_control_character_is_rejected(
    monkeypatch: pytest.MonkeyPatch, name: str, char: str
) -> None:
    assert_one_line_naming(monkeypatch, name, f"/he{char}alth")


@pytest.mark.unit
@pytest.mark.parametrize("name", ["DYN_SYSTEM_HEALTH_PATH", "DYN_SYSTEM_LIVE_PATH"])
def test_probe_path_taken_by_the_schema_route_is_rejected(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    assert_one_line_naming(monkeypatch, name, "/openapi.json")


@pytest.mark.unit
def test_health_path_on_the_live_route_names_the_health_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert_one_line_naming(monkeypatch, "DYN_SYSTEM_HEALTH_PATH", "/live")


@pytest.mark.process
def test_non_ascii_api_key_exits_2_without_traceback() -> None:
    env = {
        "SIDECAR_ENGINE_API_KEY": "ключ",
        "DYN_SYSTEM_HOST": LOOPBACK,
        "DYN_SYSTEM_PORT": str(free_port()),
        "SIDECAR_ENGINE_URL": f"http://{LOOPBACK}:{free_port()}",
    }
    done = run_cli(env=env)
    assert "Traceback" not in done.stdout + done.stderr, done.stderr[-2000:]
    assert done.returncode == 2, done.stderr[-2000:]


@pytest.mark.unit
def test_control_token_is_a_header_value_and_needs_a_port(monkeypatch: pytest.MonkeyPatch) -> None:
    line = assert_one_line_naming(monkeypatch, "SIDECAR_CONTROL_TOKEN", "two words")
    assert "two words" not in line
    with pytest.raises(ConfigError) as info:
        load(monkeypatch, SIDECAR_CONTROL_TOKEN="t0ken")
    assert info.value.lines == [
        "SIDECAR_CONTROL_TOKEN=<set>: expected SIDECAR_CONTROL_PORT too (the token guards the "
        "control routes, which are off without a port)"
    ]
    assert "t0ken" not in str(info.value.lines)
