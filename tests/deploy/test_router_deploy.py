"""deploy/ files of ``pdctl router serve``: the systemd unit (verify, exposure <= 2.0), the
Kubernetes StatefulSet + headless Service (strict 1.29 schemas), and the router configs they
carry, which must load; the daemon's [routers] in configmap.yaml must point at them."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.config import load_settings
from controller.router.config import load_router_config, parse_router_config
from tests.deploy.test_kubernetes import K8S, validate
from tests.deploy.test_systemd import MAX_EXPOSURE, SYSTEMD, analyze, local_unit

ROUTER = K8S / "router.yaml"


def docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(ROUTER.read_text()) if d]


def kind(k: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs() if d["kind"] == k and (name is None
                                                        or d["metadata"]["name"] == name)]
    assert len(found) == 1
    return found[0]


@pytest.mark.integration
def test_router_manifest_validates_strictly_for_1_29() -> None:
    out = validate(ROUTER)
    assert out.returncode == 0, out.stdout + out.stderr


def test_statefulset_headless_service_and_the_daemons_routers_agree(tmp_path: Path) -> None:
    sts = kind("StatefulSet")
    headless = kind("Service", "pd-router")
    assert headless["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == headless["metadata"]["name"]
    container = sts["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    toml = kind("ConfigMap")["data"]["router.toml"]
    cfg = parse_router_config(tomllib.loads(toml))
    assert cfg.http.listen.endswith(f":{ports['http']}")
    assert cfg.grpc.listen.endswith(f":{ports['agent-grpc']}")
    assert cfg.http.metrics_listen and cfg.http.metrics_listen.endswith(
        f":{ports['router-metrics']}")
    assert container["args"][:2] == ["router", "serve"]
    # The daemon's [routers] (configmap.yaml) names each replica by its stable DNS name.
    daemon_toml = yaml.safe_load((K8S / "configmap.yaml").read_text())["data"][
        "pd-controller.toml"]
    path = tmp_path / "d.toml"
    path.write_text(daemon_toml)
    settings = load_settings(path)
    n = sts["spec"]["replicas"]
    assert settings.routers.targets == [
        f"pd-router-{i}.pd-router:{ports['agent-grpc']}" for i in range(n)]
    assert settings.routers.metrics_targets == [
        f"pd-router-{i}.pd-router:{ports['router-metrics']}" for i in range(n)]


def test_systemd_router_config_loads() -> None:
    cfg = load_router_config(SYSTEMD / "pd-router.toml")
    assert cfg.grpc.state_file is not None and cfg.security.has_token()


@pytest.mark.integration
def test_router_unit_verifies_and_is_hardened(tmp_path: Path) -> None:
    unit = local_unit(tmp_path, (SYSTEMD / "pd-router.service").read_text())
    out = analyze("verify", str(unit))
    assert out.returncode == 0, out.stdout + out.stderr
    sec = analyze("security", "--offline=yes", f"--threshold={MAX_EXPOSURE}", str(unit))
    assert sec.returncode == 0, sec.stdout + sec.stderr
