"""deploy/kubernetes and deploy/Containerfile, validated offline.

``kubernetes-validate --strict`` checks the manifests against the 1.29 schemas (the first
version where native sidecars are on by default). Schemas do not check enum values or what
the fields mean, so the fields that matter here are checked by hand.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.config import load_settings
from tests.conftest import require

DEPLOY = Path(__file__).parents[2] / "deploy"
K8S = DEPLOY / "kubernetes"
MANIFESTS = ["configmap.yaml", "standalone.yaml", "sidecar.yaml"]


def kubernetes_validate() -> str:
    exe = Path(sys.executable).parent / "kubernetes-validate"
    found = str(exe) if exe.is_file() else shutil.which("kubernetes-validate")
    require("kubernetes-validate", found is not None, "pip install -e '.[dev]'")
    assert found is not None
    return found


def validate(path: Path, version: str = "1.29.0") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [kubernetes_validate(), "--strict", "-k", version, str(path)],
        capture_output=True, text=True, timeout=300, check=False,
    )


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def one(name: str, kind: str) -> dict[str, Any]:
    found = [d for d in docs(name) if d["kind"] == kind]
    assert len(found) == 1, f"{name}: {len(found)} {kind}"
    return found[0]


@pytest.mark.integration
@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_validates_strictly_for_1_29(name: str) -> None:
    out = validate(K8S / name)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.integration
def test_validation_catches_a_typo_and_a_too_old_cluster(tmp_path: Path) -> None:
    typo = tmp_path / "typo.yaml"
    typo.write_text((K8S / "standalone.yaml").read_text().replace("periodSeconds", "periodSecond"))
    assert validate(typo).returncode != 0
    # Native sidecars (initContainers[].restartPolicy) do not exist before 1.28.
    assert validate(K8S / "sidecar.yaml", "1.27.0").returncode != 0


def probes(container: dict[str, Any]) -> dict[str, str]:
    return {
        kind: container[kind]["httpGet"]["path"]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe")
        if "httpGet" in container.get(kind, {})
    }


STANDALONE_PROBES = {"startupProbe": "/readyz", "readinessProbe": "/readyz",
                     "livenessProbe": "/livez"}
# A sidecar's startupProbe holds its router's start, and its readiness is the Pod's: neither
# may hang the data path on the controller (or on the store it needs to start).
SIDECAR_PROBES = {"livenessProbe": "/livez"}


def check_controller_container(container: dict[str, Any], pod: dict[str, Any],
                               expected_probes: dict[str, str]) -> None:
    assert probes(container) == expected_probes
    assert set(expected_probes) == {k for k in container if k.endswith("Probe")}
    # Every probe targets a port of this very container (not the router's).
    own_ports = {p["name"] for p in container["ports"]}
    own_ports |= {p["containerPort"] for p in container["ports"]}
    for kind in expected_probes:
        assert container[kind]["httpGet"]["port"] in own_ports
    env = {e["name"]: e for e in container["env"]}
    secret = env["PDCTL_STORE__URL"]["valueFrom"]["secretKeyRef"]
    assert secret["name"] and secret["key"]
    assert "value" not in env["PDCTL_STORE__URL"]
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert not re.search(r":latest$|^[^:]+$", container["image"]), container["image"]
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    config_volume = next(v for v in pod["volumes"] if v["name"] == mounts["/etc/pd-controller"])
    configmap = one("configmap.yaml", "ConfigMap")
    assert config_volume["configMap"]["name"] == configmap["metadata"]["name"]
    assert container["args"][-1] == "/etc/pd-controller/pd-controller.toml"


def test_standalone_deployment() -> None:
    deployment = one("standalone.yaml", "Deployment")
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    check_controller_container(container, pod, STANDALONE_PROBES)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    pdb = one("standalone.yaml", "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert 0 < pdb["spec"]["minAvailable"] < deployment["spec"]["replicas"]
    service = one("standalone.yaml", "Service")
    assert service["spec"]["selector"].items() <= labels.items()
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http-metrics"]
    assert pod["serviceAccountName"] == one("standalone.yaml", "ServiceAccount")["metadata"]["name"]


def router_workload(name: str) -> dict[str, Any]:
    """The Deployment (standalone) or StatefulSet (sidecar) a manifest runs."""
    return one(name, "StatefulSet" if name == "sidecar.yaml" else "Deployment")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of an env value from the variables before it."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], value)


def test_sidecar_is_native_and_does_not_wait_on_its_router(tmp_path: Path) -> None:
    workload = router_workload("sidecar.yaml")
    pod = workload["spec"]["template"]["spec"]
    (sidecar,) = pod["initContainers"]
    assert sidecar["restartPolicy"] == "Always"  # schemas accept any string here
    check_controller_container(sidecar, pod, SIDECAR_PROBES)
    router_ports = {p["containerPort"] for c in pod["containers"] for p in c["ports"]}
    sidecar_ports = {p["containerPort"] for p in sidecar["ports"]}
    assert not router_ports & sidecar_ports
    assert 50151 in router_ports
    # Sidecar mode is [controller] sidecar_router; the shared [routers] targets stay the
    # ConfigMap's, so the leader decides for every router.
    names = [e["name"] for e in sidecar["env"]]
    assert "PDCTL_CONTROLLER__SIDECAR_ROUTER" in names
    assert not any(n.startswith("PDCTL_ROUTERS__") for n in names)
    pod_name = next(e for e in sidecar["env"] if e["name"] == "POD_NAME")
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # Each replica's own router, by a name the ConfigMap lists: expand the env as the
    # kubelet would for every replica and load the real config with it.
    service = one("sidecar.yaml", "Service")
    assert workload["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True  # the sidecar starts first
    toml = tmp_path / "pd-controller.toml"
    toml.write_text(one("configmap.yaml", "ConfigMap")["data"]["pd-controller.toml"])
    base = load_settings(toml)
    replicas = workload["spec"]["replicas"]
    assert len(base.routers.targets) == replicas
    seen = set()
    for i in range(replicas):
        env = {"POD_NAME": f"{workload['metadata']['name']}-{i}"}
        for e in sidecar["env"]:
            if "value" in e:
                env[e["name"]] = expand(e["value"], env)
        mine = env["PDCTL_CONTROLLER__SIDECAR_ROUTER"]
        assert mine in base.routers.targets
        assert mine.rsplit(":", 1)[1] == "50151"
        seen.add(mine)
    assert seen == set(base.routers.targets)
    # The router's agent reads the same [security] (mutual TLS + token) from the same files,
    # and is probed without gRPC: the kubelet's gRPC probe cannot speak TLS.
    (router,) = pod["containers"]
    mounts = {(m["name"], m["mountPath"]) for m in sidecar["volumeMounts"]
              if m["name"] != "tmp"}
    assert mounts <= {(m["name"], m["mountPath"]) for m in router["volumeMounts"]}
    assert "grpc" not in router["readinessProbe"]
    assert base.security.uses_tls() and base.security.tls_cert is not None
    files = [base.security.tls_cert, base.security.tls_key, base.security.tls_ca,
             base.security.token_file]
    assert {f.parent.as_posix() for f in files if f} == {
        m["mountPath"] for m in sidecar["volumeMounts"] if m["name"] == "router-credentials"}


SIDECAR_OF_ROUTER_0 = {"controller": {"sidecar_router": "pd-router-0.pd-router:50151"}}


@pytest.mark.parametrize("override", [{}, SIDECAR_OF_ROUTER_0])
def test_configmap_is_a_valid_config(tmp_path: Path, override: dict[str, Any]) -> None:
    toml = one("configmap.yaml", "ConfigMap")["data"]["pd-controller.toml"]
    path = tmp_path / "pd-controller.toml"
    path.write_text(toml)
    settings = load_settings(path, **override)
    assert settings.metrics.listen.startswith("0.0.0.0:")
    port = int(settings.metrics.listen.rsplit(":", 1)[1])
    for name in ("standalone.yaml", "sidecar.yaml"):
        pod = router_workload(name)["spec"]["template"]["spec"]
        controller = next(
            c for c in pod.get("initContainers", []) + pod["containers"]
            if c["name"] == "pd-controller"
        )
        assert port in {p["containerPort"] for p in controller["ports"]}


def containerfile_instructions() -> list[tuple[str, str]]:
    text = (DEPLOY / "Containerfile").read_text()
    text = re.sub(r"\\\n", " ", text)  # join continuation lines
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def test_containerfile_is_multi_stage_non_root_and_pinned() -> None:
    steps = containerfile_instructions()
    args = dict(a.split("=", 1) for k, a in steps if k == "ARG" and "=" in a)
    froms = [rest for k, rest in steps if k == "FROM"]
    assert len(froms) >= 2
    stages = [f.split()[-1] for f in froms if " AS " in f.upper()]
    assert len(stages) == len(froms)
    for f in froms:
        image = f.split()[0]
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        assert ":" in image.rsplit("/", 1)[-1], f"untagged base image {image}"
        assert not image.endswith(":latest"), image
    # The final stage copies from an earlier one and runs as a numeric non-root user.
    final = max(i for i, (k, _) in enumerate(steps) if k == "FROM")
    tail = steps[final:]
    assert any(k == "COPY" and r.startswith("--from=") for k, r in tail)
    users = [r for k, r in tail if k == "USER"]
    assert users and users[-1].split(":")[0] not in {"0", "root"}
    assert users[-1].split(":")[0].isdigit()  # runAsNonRoot can check a numeric uid
    entrypoint = [r for k, r in tail if k == "ENTRYPOINT"]
    assert entrypoint and yaml.safe_load(entrypoint[-1]) == ["pdctl"]
    uid = int(users[-1].split(":")[0])
    for name in ("standalone.yaml", "sidecar.yaml"):
        pod = router_workload(name)["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == uid
