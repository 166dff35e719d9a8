"""Configuration: every malformed value stops the sidecar with one line naming the variable."""

from __future__ import annotations

import json
import sys

import pytest

from sidecar.config import ConfigError, Settings
from sidecar.core.vocabulary import Mode
from tests.support.configured import run_cli, settings_from
from tests.support.harness import ROOT


@pytest.mark.unit
def test_defaults(monkeypatch):
    s = settings_from(monkeypatch)
    assert s.health_check_enabled is False
    assert s.use_endpoint_health_status == ()
    assert (s.canary_wait_time, s.request_timeout) == (10.0, 3.0)
    assert (s.system_host, s.system_port) == ("0.0.0.0", 9090)
    assert (s.health_path, s.live_path) == ("/health", "/live")
    assert s.engine_url == "http://127.0.0.1:8000"
    assert (s.backend, s.disaggregation_mode) == ("vllm", Mode.AGGREGATED)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("env", "field", "value"),
    [
        ({"DYN_HEALTH_CHECK_ENABLED": "true"}, "health_check_enabled", True),
        ({"DYN_HEALTH_CHECK_ENABLED": "0"}, "health_check_enabled", False),
        (
            {"DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": '["generate"]'},
            "use_endpoint_health_status",
            ("generate",),
        ),
        ({"DYN_CANARY_WAIT_TIME": "0.25"}, "canary_wait_time", 0.25),
        ({"DYN_SYSTEM_PORT": "65535"}, "system_port", 65535),
        ({"SIDECAR_DISAGGREGATION_MODE": "agg"}, "disaggregation_mode", Mode.AGGREGATED),
        (
            {"SIDECAR_DISAGGREGATION_MODE": "prefill_and_decode"},
            "disaggregation_mode",
            Mode.AGGREGATED,
        ),
        ({"SIDECAR_ENGINE_URL": "http://engine:8080/"}, "engine_url", "http://engine:8080"),
        ({"DYN_HEALTH_CHECK_PAYLOAD": '{"prompt": "x"}'}, "health_check_payload", {"prompt": "x"}),
        ({"DYN_SYSTEM_PORT": ""}, "system_port", 9090),  # empty means unset, as in Dynamo
    ],
)
def test_valid_values(monkeypatch, env, field, value):
    assert getattr(settings_from(monkeypatch, **env), field) == value


@pytest.mark.unit
@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS", "generate", "JSON list"),
        (
            "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS",
            '["generate", "clear_kv_blocks"]',
            "does not monitor 'clear_kv_blocks'",
        ),
        ("DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS", '{"generate": 1}', "JSON list"),
        ("SIDECAR_DISAGGREGATION_MODE", "decoder", "one of aggregated"),
        ("SIDECAR_BACKEND", "tgi", "one of vllm, sglang, trtllm, openai"),
        ("DYN_SYSTEM_PORT", "70000", "port from 1 to 65535"),
        ("DYN_SYSTEM_PORT", "0", "port from 1 to 65535"),
        ("DYN_SYSTEM_PORT", "http", "port from 1 to 65535"),
        ("DYN_HEALTH_CHECK_REQUEST_TIMEOUT", "-1", "seconds > 0"),
        ("DYN_CANARY_WAIT_TIME", "nan", "seconds > 0"),
        ("DYN_CANARY_WAIT_TIME", "inf", "seconds > 0"),
        ("DYN_HEALTH_CHECK_ENABLED", "sometimes", "true or false"),
        ("DYN_SYSTEM_STARTING_HEALTH_STATUS", "healthy", "ready or notready"),
        ("DYN_HEALTH_CHECK_PAYLOAD", "@/nonexistent/payload.json", "is not a regular file"),
        # A device or a FIFO would never end (or hang) the read: refused before it starts.
        ("DYN_HEALTH_CHECK_PAYLOAD", "@/dev/zero", "'/dev/zero' is not a regular file"),
        ("DYN_HEALTH_CHECK_PAYLOAD", "[1, 2]", "JSON object"),
        ("DYN_HEALTH_CHECK_PAYLOAD", "{bad", "JSON object"),
        ("DYN_SYSTEM_HEALTH_PATH", "health", "URL path"),
        ("DYN_SYSTEM_LIVE_PATH", "/metrics", "not already used"),
        ("SIDECAR_ENGINE_URL", "ftp://x", "http:// or https://"),
        ("SIDECAR_ENGINE_URL", "http://:80", "http:// or https://"),
        ("SIDECAR_FAILURE_THRESHOLD", "0", "integer from 1 to 100"),
        ("SIDECAR_MODEL", "   ", "model name"),
    ],
)
def test_malformed_value_names_variable(monkeypatch, name, value, expected):
    with pytest.raises(ConfigError) as info:
        settings_from(monkeypatch, **{name: value})
    assert len(info.value.lines) == 1
    line = info.value.lines[0]
    assert line.startswith(f"{name}=")
    assert expected in line
    assert "\n" not in line


@pytest.mark.unit
def test_live_and_health_paths_must_differ(monkeypatch):
    with pytest.raises(ConfigError) as info:
        settings_from(monkeypatch, DYN_SYSTEM_HEALTH_PATH="/x", DYN_SYSTEM_LIVE_PATH="/x")
    assert info.value.lines[0].startswith("DYN_SYSTEM_LIVE_PATH=")


@pytest.mark.unit
def test_a_payload_file_over_a_mebibyte_is_refused_unread(monkeypatch, tmp_path):
    path = tmp_path / "payload.json"
    path.write_text('{"prompt": "' + "x" * (1 << 20) + '"}')
    with pytest.raises(ConfigError) as info:
        settings_from(monkeypatch, DYN_HEALTH_CHECK_PAYLOAD=f"@{path}")
    (line,) = info.value.lines
    assert line.startswith("DYN_HEALTH_CHECK_PAYLOAD=")
    assert "holds more than 1048576 bytes" in line


@pytest.mark.unit
def test_payload_file(monkeypatch, tmp_path):
    path = tmp_path / "payload.json"
    path.write_text(json.dumps({"prompt": [1, 2], "max_tokens": 1}))
    s = settings_from(monkeypatch, DYN_HEALTH_CHECK_PAYLOAD=f"@{path}")
    assert s.health_check_payload == {"prompt": [1, 2], "max_tokens": 1}


@pytest.mark.process
def test_bad_config_exits_nonzero_with_one_line_and_no_traceback():
    done = run_cli(env={"DYN_SYSTEM_PORT": "70000"})
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert "DYN_SYSTEM_PORT='70000'" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


@pytest.mark.process
def test_check_config_prints_the_plan():
    env = {
        "DYN_HEALTH_CHECK_ENABLED": "true",
        "SIDECAR_BACKEND": "trtllm",
        "SIDECAR_DISAGGREGATION_MODE": "decode",
        "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS": '["generate"]',
        "SIDECAR_ENGINE_API_KEY": "sk-secret-value",
    }
    done = run_cli("--check-config", env=env)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "POST /v1/completions" in out
    assert '"disaggregated_params": {"request_type": "context_and_generation"}' in out
    assert "DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS" in out
    assert "notready after 2 consecutive failure(s)" in out
    assert "sk-secret-value" not in out


@pytest.mark.process
def test_check_config_rejects_like_startup():
    done = run_cli("--check-config", env={"SIDECAR_DISAGGREGATION_MODE": "decoder"})
    assert done.returncode == 2
    assert done.stderr.startswith(
        "health-sidecar: configuration error: SIDECAR_DISAGGREGATION_MODE="
    )


@pytest.mark.process
def test_env_file(tmp_path):
    env_file = tmp_path / "worker.env"
    env_file.write_text(
        "SIDECAR_BACKEND=sglang\nSIDECAR_DISAGGREGATION_MODE=prefill\n"
        "DYN_HEALTH_CHECK_ENABLED=true\n"
    )
    done = run_cli("--env-file", str(env_file), "--check-config")
    assert done.returncode == 0, done.stderr
    assert '"bootstrap_host": "2.2.2.2"' in done.stdout
    missing = run_cli("--env-file", str(tmp_path / "nope.env"), "--check-config")
    assert missing.returncode == 2
    assert "--env-file=" in missing.stderr


@pytest.mark.process
def test_a_missing_runtime_is_refused_at_start_with_the_command_that_installs_it(tmp_path):
    """Validation does not depend on the machine: --check-config passes a Dynamo profile where
    the dynamo extra is not installed (valid, but it cannot start here: exit 3, the missing
    extra named), and the sidecar refuses to start there, exit 3, one line with the command that
    works where it is installed from."""
    hidden = tmp_path / "no-runtime"
    (hidden / "dynamo").mkdir(parents=True)
    (hidden / "dynamo" / "__init__.py").write_text("")  # a dynamo package without its runtime
    env = {"PYTHONPATH": str(hidden)}
    profile = str(ROOT / "config" / "dynamo-vllm-decode.env")
    hint = f"{sys.executable} -m pip install -e '{ROOT}[dynamo]'"

    checked = run_cli("--env-file", profile, "--check-config", env=env)
    assert checked.returncode == 3, checked.stderr
    assert checked.stdout.startswith(
        "health-sidecar: configuration is valid, but it cannot start here (exit 3):\n"
        "  missing      SIDECAR_TRANSPORT=dynamo: expected"
    )
    assert hint in checked.stdout

    started = run_cli("--env-file", profile, env=env)
    assert started.returncode == 3
    (line,) = started.stderr.strip().splitlines()
    assert line.startswith("health-sidecar: cannot start: SIDECAR_TRANSPORT=dynamo: expected")
    assert hint in line


@pytest.mark.unit
def test_the_stall_windows_help_says_the_default_the_policy_computes():
    """The configuration reference's words for the default are the policy's own (one source: the
    help cannot import the policy, which the configuration does not load)."""
    from sidecar.core.evidence.policy import STALL_WINDOW_DEFAULT

    help_text = " ".join(Settings.model_fields["stall_window"].description.split())
    assert f"Unset: {STALL_WINDOW_DEFAULT} (" in help_text
