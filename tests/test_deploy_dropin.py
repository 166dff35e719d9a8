"""Drop-in wiring, checked offline: the kustomize Component, the DynamoGraphDeployment and the
LeaderWorkerSet examples.

The Component is rendered with kustomize (on an example Deployment, on a Deployment made here with
another engine name and an init container of its own) and validated with kubernetes-validate. The
CRDs (DGD, LWS) have no schema here: their YAML is parsed and the fields the operator's and LWS's
APIs name are checked, and their pod specs are validated as plain Pods. Everywhere, the engine's
probes must be what `health-sidecar probes` prints for the sidecar's own settings.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar.config import Settings
from sidecar.tools.probes import render
from sidecar.wiring import resolve
from tests.support.configured import settings_from
from tests.support.deployfiles import (
    MAX_LOAD_SECONDS,
    OLDEST_K8S,
    kustomize,
    missing,
    need,
    newest_k8s,
    read_env,
    run,
)
from tests.support.harness import ROOT

KUBE = ROOT / "deploy" / "kubernetes"
COMPONENT = KUBE / "components" / "health-sidecar"
EXAMPLES = KUBE / "examples"
LEAF_OVERLAYS = (
    "vllm-aggregated",
    "vllm-epd-encode",
    "sglang-disaggregated/prefill",
    "sglang-disaggregated/decode",
    "trtllm-disaggregated/prefill",
    "trtllm-disaggregated/decode",
    "smg-grpc-workers/vllm-grpc",
    "smg-grpc-workers/sglang-grpc",
)
DGD = ROOT / "deploy" / "dynamo" / "dgd-vllm-disagg.yaml"
LWS = ROOT / "deploy" / "lws" / "vllm-multinode.yaml"
SIDECAR = "health-sidecar"
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")
DYNAMO_SYSTEM_PORT = 9090  # the operator's port named `system`, the worker's own


def load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def expected_probes(settings: Settings) -> dict[str, Any]:
    return yaml.safe_load(render(resolve(settings), MAX_LOAD_SECONDS))


def only(items: list[dict[str, Any]], name: str) -> dict[str, Any]:
    matches = [c for c in items if c["name"] == name]
    assert len(matches) == 1, f"no single {name!r} in {[c['name'] for c in items]}"
    return matches[0]


def inline_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def assert_sidecar_secure(sidecar: dict[str, Any]) -> None:
    assert sidecar["restartPolicy"] == "Always"
    security = sidecar["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] == 10001
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert {"requests", "limits"} <= set(sidecar["resources"])
    assert sidecar["startupProbe"]["httpGet"]["path"] == "/sidecar/live"
    for name in PROBES:
        if name in sidecar:  # its own probes judge only itself, never the engine
            assert sidecar[name]["httpGet"]["path"] == "/sidecar/live"


def validate_strict(docs: list[dict[str, Any]], tmp_path: Path) -> None:
    validator = need("kubernetes-validate", "pip install kubernetes-validate")
    path = tmp_path / "docs.yaml"
    path.write_text(yaml.safe_dump_all(docs), encoding="utf-8")
    for version in (OLDEST_K8S, newest_k8s(validator)):
        proc = run([validator, "--strict", "--quiet", "-k", version, str(path)])
        assert proc.returncode == 0, f"{version}: {proc.stdout}{proc.stderr}"


def as_pod(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


# --- the kustomize Component ---------------------------------------------------------------------


def build(path: Path) -> list[dict[str, Any]]:
    command = kustomize()
    if command is None:
        missing("neither kustomize nor kubectl (kubectl kustomize) found on PATH")
    proc = run([*command, "--load-restrictor", "LoadRestrictionsNone", str(path)])
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.mark.unit
def test_component_targets_every_deployment():
    (kust,) = load(COMPONENT / "kustomization.yaml")
    assert kust["apiVersion"] == "kustomize.config.k8s.io/v1alpha1"
    assert kust["kind"] == "Component"
    assert kust["patches"]
    for patch in kust["patches"]:
        assert patch["target"] == {"group": "apps", "version": "v1", "kind": "Deployment"}


@pytest.mark.unit
@pytest.mark.parametrize("overlay", LEAF_OVERLAYS)
def test_overlays_use_the_component(overlay: str):
    (kust,) = load(KUBE / "overlays" / overlay / "kustomization.yaml")
    found = [(KUBE / "overlays" / overlay / c).resolve() for c in kust.get("components", [])]
    assert found == [COMPONENT.resolve()]


@pytest.mark.unit
def test_base_no_longer_defines_the_sidecar():
    text = (KUBE / "base" / "worker.yaml").read_text(encoding="utf-8")
    assert "initContainers" not in text
    assert "Probe:" not in text


def check_component_output(
    docs: list[dict[str, Any]], engine_name: str, monkeypatch: pytest.MonkeyPatch
) -> dict[str, Any]:
    """The rendered Deployment: sidecar wired, engine probes as `health-sidecar probes` says."""
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    spec = deployment["spec"]["template"]["spec"]
    sidecar = only(spec["initContainers"], SIDECAR)
    assert_sidecar_secure(sidecar)
    assert "readinessProbe" not in sidecar
    (ref,) = sidecar["envFrom"]
    (cm,) = [
        d
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == ref["configMapRef"]["name"]
    ]
    settings = settings_from(monkeypatch, **cm["data"])
    assert settings.system_port in [p["containerPort"] for p in sidecar["ports"]]
    engine = spec["containers"][0]
    assert engine["name"] == engine_name
    expected = expected_probes(settings)
    for name in PROBES:
        assert engine[name] == expected[name], name
    for other in spec["containers"][1:]:
        assert not set(PROBES) & set(other), "only the first container gets the probes"
    return spec


@pytest.mark.process
def test_component_on_the_example_deployment(monkeypatch, tmp_path: Path):
    docs = build(EXAMPLES / "any-deployment")
    check_component_output(docs, "vllm", monkeypatch)
    validate_strict(docs, tmp_path)


@pytest.mark.process
def test_grpc_example_probes_the_grpc_health_service(monkeypatch, tmp_path: Path):
    """The example whose engine probes are kubelet grpc probes: exactly what `probes --grpc`
    prints for its sidecar's settings, on the port the sidecar declares; valid Kubernetes."""
    docs = build(EXAMPLES / "grpc-probes")
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    spec = deployment["spec"]["template"]["spec"]
    sidecar = only(spec["initContainers"], SIDECAR)
    assert_sidecar_secure(sidecar)
    (ref,) = sidecar["envFrom"]
    (cm,) = [
        d
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == ref["configMapRef"]["name"]
    ]
    settings = settings_from(monkeypatch, **cm["data"])
    assert settings.grpc_port is not None
    ports = [p["containerPort"] for p in sidecar["ports"]]
    assert settings.grpc_port in ports
    assert settings.system_port in ports
    engine = spec["containers"][0]
    expected = yaml.safe_load(render(resolve(settings), MAX_LOAD_SECONDS, grpc=True))
    services = {"startupProbe": "readiness", "livenessProbe": "liveness"}
    for name in PROBES:
        assert engine[name] == expected[name], name
        assert "httpGet" not in engine[name], name
        want = {"port": settings.grpc_port, "service": services.get(name, "readiness")}
        assert engine[name]["grpc"] == want, name
    # The same numbers as the httpGet probes.
    http = expected_probes(settings)
    for name in PROBES:
        assert {k: v for k, v in engine[name].items() if k != "grpc"} == {
            k: v for k, v in http[name].items() if k != "httpGet"
        }, name
    validate_strict(docs, tmp_path)


POD_RESTART_K8S = "1.36.0"  # RestartAllContainers on by default (KEP-5532 beta)


@pytest.mark.process
def test_pod_restart_example_restarts_the_pod_on_the_sidecars_own_code(monkeypatch, tmp_path):
    """The sidecar's restartPolicyRules match exactly the code its settings exit with, as
    RestartAllContainers; the engine keeps its probes (liveness on /live among them); valid from
    the Kubernetes its first line names, and refused by the one before."""
    example = EXAMPLES / "pod-restart"
    docs = build(example)
    spec = check_component_output(docs, "vllm", monkeypatch)
    sidecar = only(spec["initContainers"], SIDECAR)
    (ref,) = sidecar["envFrom"]
    (cm,) = [
        d
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == ref["configMapRef"]["name"]
    ]
    code = settings_from(monkeypatch, **cm["data"]).pod_restart_exit_code
    assert code is not None
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["restartPolicyRules"] == [
        {"action": "RestartAllContainers", "exitCodes": {"operator": "In", "values": [code]}}
    ]
    first = (example / "kustomization.yaml").read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith(f"# oldest Kubernetes: {POD_RESTART_K8S} "), first
    validator = need("kubernetes-validate", "pip install kubernetes-validate")
    path = tmp_path / "docs.yaml"
    path.write_text(yaml.safe_dump_all(docs), encoding="utf-8")
    for version in (POD_RESTART_K8S, newest_k8s(validator)):
        proc = run([validator, "--strict", "--quiet", "-k", version, str(path)])
        assert proc.returncode == 0, f"{version}: {proc.stdout}{proc.stderr}"
    older = run([validator, "--strict", "--quiet", "-k", OLDEST_K8S, str(path)])
    assert older.returncode != 0, "a cluster without the rules should refuse the example"


@pytest.mark.process
def test_component_on_any_deployment(monkeypatch, tmp_path: Path):
    """A Deployment with its own init container, a second container and another engine name."""
    app = tmp_path / "app"
    app.mkdir()
    labels = {"app": "x"}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "x"},
        "spec": {
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "initContainers": [{"name": "fetch-model", "image": "busybox:1.36"}],
                    "containers": [
                        {"name": "sglang", "image": "lmsysorg/sglang:v0.5.15"},
                        {"name": "log-shipper", "image": "fluent/fluent-bit:3.2"},
                    ],
                },
            },
        },
    }
    (app / "deployment.yaml").write_text(yaml.safe_dump(deployment), encoding="utf-8")
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": ["deployment.yaml"],
        "components": [os.path.relpath(COMPONENT, app)],  # kustomize wants it relative
        "configMapGenerator": [
            {"name": "health-sidecar-env", "envs": [str(ROOT / "config" / "sglang-decode.env")]}
        ],
    }
    (app / "kustomization.yaml").write_text(yaml.safe_dump(kustomization), encoding="utf-8")
    docs = build(app)
    spec = check_component_output(docs, "sglang", monkeypatch)
    # kustomize's strategic merge puts the new entry first: the sidecar starts before the others.
    assert [c["name"] for c in spec["initContainers"]] == [SIDECAR, "fetch-model"]
    validate_strict(docs, tmp_path)


# --- DynamoGraphDeployment -----------------------------------------------------------------------


def dgd() -> dict[str, Any]:
    (doc,) = load(DGD)
    return doc


def workers() -> dict[str, dict[str, Any]]:
    services = dgd()["spec"]["services"]
    return {n: s for n, s in services.items() if s.get("componentType") == "worker"}


@pytest.mark.unit
def test_dgd_is_a_disaggregated_graph():
    doc = dgd()
    assert doc["apiVersion"] == "nvidia.com/v1alpha1"
    assert doc["kind"] == "DynamoGraphDeployment"
    types = {s["componentType"] for s in doc["spec"]["services"].values()}
    assert types == {"frontend", "worker"}
    roles = sorted(s["subComponentType"] for s in workers().values())
    assert roles == ["decode", "prefill"]
    for service in workers().values():
        args = service["extraPodSpec"]["mainContainer"]["args"]
        mode = service["subComponentType"]
        assert args[args.index("--disaggregation-mode") + 1] == mode


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(workers()))
def test_dgd_worker_probes_target_its_sidecar(name: str, monkeypatch):
    service = workers()[name]
    pod = service["extraPodSpec"]
    sidecar = only(pod["initContainers"], SIDECAR)
    assert_sidecar_secure(sidecar)
    env = inline_env(sidecar)
    settings = settings_from(monkeypatch, **env)
    # The role, said to the sidecar.
    assert settings.backend == "vllm"
    assert str(settings.disaggregation_mode) == service["subComponentType"]
    # Canaries on, over Dynamo's request plane (a Dynamo worker serves no HTTP generation API),
    # found on the worker's own system server, under the operator's Kubernetes discovery.
    assert settings.health_check_enabled
    assert settings.transport == "dynamo"
    assert settings.discovery_backend == "kubernetes"
    assert env["SIDECAR_ENGINE_URL"] == f"http://127.0.0.1:{DYNAMO_SYSTEM_PORT}"
    assert sidecar["image"].endswith("-dynamo")  # built with the [dynamo] extra
    # Its private discovery directory in /tmp (the root filesystem is read-only), and no
    # service-account token: it needs no rights on the cluster.
    # The same settings as its profile (config/dynamo-vllm-<mode>.env).
    profile = ROOT / "config" / f"dynamo-vllm-{service['subComponentType']}.env"
    assert env == dict(
        line.split("=", 1)
        for line in profile.read_text().splitlines()
        if line and not line.startswith("#")
    )
    mounts = {m["mountPath"]: m["name"] for m in sidecar["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert "emptyDir" in volumes[mounts["/var/run/secrets/kubernetes.io/serviceaccount"]]
    # Its own port: 9090 is the worker's (the operator's `system` port).
    assert settings.system_port != DYNAMO_SYSTEM_PORT
    assert [p["containerPort"] for p in sidecar["ports"]] == [settings.system_port]
    expected = expected_probes(settings)
    main = pod["mainContainer"]
    for probe in PROBES:
        assert main[probe] == expected[probe], probe
        assert main[probe]["httpGet"]["port"] == settings.system_port
    # The service-level fields replace the operator's defaults (liveness /live, threshold 1).
    for probe in ("livenessProbe", "readinessProbe"):
        assert service[probe] == main[probe], probe
    assert service["livenessProbe"]["failureThreshold"] > 1
    assert service["livenessProbe"]["httpGet"]["port"] != DYNAMO_SYSTEM_PORT


@pytest.mark.process
def test_dgd_pod_specs_are_valid_pods(tmp_path: Path):
    pods = []
    for name, service in workers().items():
        spec = dict(service["extraPodSpec"])
        main = dict(spec.pop("mainContainer"), name="main")
        pods.append(as_pod(name.lower(), dict(spec, containers=[main])))
    validate_strict(pods, tmp_path)


# --- LeaderWorkerSet -----------------------------------------------------------------------------


def lws_docs() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in load(LWS)}


@pytest.mark.unit
def test_lws_sidecar_on_the_leader_without_liveness(monkeypatch):
    docs = lws_docs()
    lws = docs["LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] >= 2
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader = template["leaderTemplate"]["spec"]
    sidecar = only(leader["initContainers"], SIDECAR)
    assert_sidecar_secure(sidecar)
    # A sidecar restart would recreate the whole group: no liveness probe of its own.
    assert "livenessProbe" not in sidecar
    # Workers: no sidecar.
    worker = template["workerTemplate"]["spec"]
    assert SIDECAR not in [c["name"] for c in worker.get("initContainers", [])]
    assert SIDECAR not in [c["name"] for c in worker["containers"]]
    # Its settings are config/vllm-aggregated.env; the leader engine's probes follow them.
    (ref,) = sidecar["envFrom"]
    assert ref["configMapRef"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    data = docs["ConfigMap"]["data"]
    assert data == read_env(ROOT / "config" / "vllm-aggregated.env")
    settings = settings_from(monkeypatch, **data)
    engine = leader["containers"][0]
    expected = expected_probes(settings)
    for probe in PROBES:
        assert engine[probe] == expected[probe], probe


@pytest.mark.unit
def test_lws_startup_policy_does_not_deadlock():
    """LeaderReady waits for the leader Pod to be Ready before creating the workers; the leader's
    readiness is the sidecar's /health, which needs the workers. So: LeaderCreated."""
    lws = lws_docs()["LeaderWorkerSet"]
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
    readiness_needs_the_group = any(
        c.get("readinessProbe", {}).get("httpGet", {}).get("path") == "/health"
        for c in leader["containers"]
    )
    assert readiness_needs_the_group
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"


@pytest.mark.process
def test_lws_core_objects_and_pod_templates_are_valid(tmp_path: Path):
    docs = lws_docs()
    template = docs["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    pods = [
        as_pod("leader", template["leaderTemplate"]["spec"]),
        as_pod("worker", template["workerTemplate"]["spec"]),
    ]
    validate_strict([docs["ConfigMap"], docs["Service"], *pods], tmp_path)
