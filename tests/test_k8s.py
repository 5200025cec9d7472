"""The Kubernetes manifests (k8s/) and the image (Dockerfile), checked offline.

Every overlay, alone and with every optional component, is rendered with the venv's kubectl
(kustomize) and validated against the Kubernetes schemas (strict). Each container's command and
args go through the program's own parser, with the container's environment in place, so a
manifest cannot name a flag or an env value the program does not take; ports, probes, Services,
NetworkPolicies, Secrets and memory sizes are checked against what the parsed programs do.
"""

import concurrent.futures
import importlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path
from unittest import mock

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
KUBECTL = Path(sys.executable).parent / "kubectl"
OVERLAYS = {"base": "base", "tcp": "overlays/tcp", "rdma": "overlays/rdma", "same-node": "overlays/same-node"}
COMPONENTS = ["components/servicemonitor", "components/hpa", "components/handshake"]
VARIANTS = [*OVERLAYS, *(f"{name}+components" for name in OVERLAYS if name != "base")]
IMAGE = "ghcr.io/example-org/epd-encode-worker"
RETAGGED = "registry.example.com/epd/epd-encode-worker:0.1.1"  # an operator's `images:` entry
MIN_KUBERNETES = "1.30.0"  # the preStop `sleep` action (docs/deploy.md)
POD_IP = "10.1.2.3"  # what the downward API's status.podIP stands for here
NAMESPACE = {"kubernetes.io/metadata.name": "epd"}
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def _render(directory: Path) -> list[dict]:
    result = subprocess.run([str(KUBECTL), "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    out = {name: _render(K8S / path) for name, path in OVERLAYS.items()}
    for name, path in OVERLAYS.items():
        if name == "base":
            continue
        work = tmp_path_factory.mktemp(name)  # an operator's overlay; kustomize takes relative paths only
        resources, components = ([os.path.relpath(K8S / target, work) for target in group]
                                 for group in ([path], COMPONENTS))
        (work / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": resources, "components": components,
            "images": [{"name": IMAGE, "newName": RETAGGED.split(":")[0], "newTag": RETAGGED.split(":")[1]}]}))
        out[f"{name}+components"] = _render(work)
    return out


# ---- helpers over rendered objects --------------------------------------------------------------

def of_kind(objects, kind):
    return [o for o in objects if o["kind"] == kind]


def pod_specs(objects):
    """(workload name, pod template) of every workload."""
    return [(o["metadata"]["name"], o["spec"]["template"]) for o in of_kind(objects, "Deployment")]


def containers(template):
    spec = template["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels is evaluated here: {selector}"
    return all(labels.get(key) == value for key, value in selector.get("matchLabels", {}).items())


def port_number(port, container) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    return number


def container_env(container) -> dict[str, str]:
    env = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        else:
            assert entry["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}, entry
            env[entry["name"]] = POD_IP
    return env


def parsed(container):
    """The container's command + args through the program's own parser, under its env."""
    command = container["command"]
    assert len(command) == 1 and command[0] in SCRIPTS, f"{command} is not one of the console scripts {SCRIPTS}"
    module = importlib.import_module(SCRIPTS[command[0]].split(":")[0])
    env = container_env(container)
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in container.get("args", [])]
    with mock.patch.dict(os.environ, env, clear=True):
        return command[0], module.build_parser().parse_args(args)


def listening_ports(program, args) -> dict[str, int]:
    if program == "epd-encode-worker":
        return {"bootstrap": args.bootstrap_port, "intake": args.intake_port}
    return {"http": args.port}


def mooncake_range(container) -> tuple[int, int]:
    env = container_env(container)
    return int(env["MC_MIN_RPC_PORT"]), int(env["MC_MAX_RPC_PORT"])


def runs_mooncake(container) -> bool:
    return "mooncake" in getattr(parsed(container)[1], "transports", "").split(",")


def served_paths(program) -> set[str]:
    if program == "epd-prefill":
        from prefill_side.server import create_app
        app = create_app(None)
    else:  # the encode worker serves the handshake app on its bootstrap port
        from handshake.app import create_app
        app = create_app()
    return {route.path for route in app.routes}


def memory_bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "": 1}
    number, unit = re.fullmatch(r"(\d+)([KMG]i)?", quantity).groups()
    return int(number) * units[unit or ""]


# ---- schemas -----------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_every_object_validates_against_the_kubernetes_schemas(rendered, variant):
    for obj in rendered[variant]:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: test_service_monitors_scrape_real_ports checks it
        for version in (MIN_KUBERNETES, kubernetes_validate.latest_version() + ".0"):
            kubernetes_validate.validate(obj, version, strict=True)


def test_strict_validation_refuses_a_misspelt_field(rendered):
    (deployment, *_) = of_kind(rendered["tcp"], "Deployment")
    deployment = json.loads(json.dumps(deployment))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, MIN_KUBERNETES, strict=True)


def test_one_images_entry_retags_every_container(rendered):
    for variant in VARIANTS:
        images = {c["image"] for _, t in pod_specs(rendered[variant]) for c in containers(t)}
        assert images == ({RETAGGED} if variant.endswith("+components") else {f"{IMAGE}:0.1.0"})


def test_components_add_what_they_promise(rendered):
    kinds = {o["kind"] for o in rendered["tcp+components"]} - {o["kind"] for o in rendered["tcp"]}
    assert kinds == {"ServiceMonitor", "HorizontalPodAutoscaler"}
    names = {o["metadata"]["name"] for o in of_kind(rendered["tcp+components"], "Deployment")}
    assert names == {"epd-encode-worker", "epd-prefill", "epd-handshake"}


# ---- containers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_every_command_parses_with_the_programs_own_parser(rendered, variant):
    programs = set()
    for _, template in pod_specs(rendered[variant]):
        for container in containers(template):
            program, args = parsed(container)
            programs.add(program)
            if program == "epd-encode-worker":
                assert args.host == POD_IP, "peers reach the worker at --host: it must be the pod IP"
                assert args.device.startswith("cuda") and args.bind == "0.0.0.0"
            if program == "epd-prefill" and "mooncake" in args.transports.split(","):
                assert args.mooncake_host == POD_IP, "encode workers write to --mooncake-host: the pod IP"
    assert {"epd-encode-worker", "epd-prefill"} <= programs


@pytest.mark.parametrize("variant", VARIANTS)
def test_images_are_pinned_and_every_container_is_bounded_and_unprivileged(rendered, variant):
    for name, template in pod_specs(rendered[variant]):
        spec = template["spec"]
        assert spec["automountServiceAccountToken"] is False
        # Service links inject EPD_PREFILL_PORT=tcp://... and EPD_HANDSHAKE_PORT=tcp://..., which the
        # programs read as their own --port defaults.
        assert spec["enableServiceLinks"] is False, name
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in containers(template):
            image = container["image"]
            assert "@sha256:" in image or re.search(r":[\w.-]+$", image.rsplit("/", 1)[-1]), image
            assert not image.endswith(":latest"), image
            resources = container["resources"]
            for kind in ("cpu", "memory"):
                assert kind in resources["requests"] and kind in resources["limits"], (name, container["name"])
            assert memory_bytes(resources["requests"]["memory"]) <= memory_bytes(resources["limits"]["memory"])
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True
            assert security["capabilities"]["drop"] == ["ALL"]
            added = security["capabilities"].get("add", [])
            if variant.startswith("rdma") and runs_mooncake(container):
                assert added == ["IPC_LOCK"], "RDMA registration pins memory"
                assert spec["securityContext"]["runAsUser"] == 0, "added capabilities reach root processes only"
            else:
                assert added == [] and spec["securityContext"]["runAsNonRoot"] is True, (name, container["name"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_encode_workers_get_a_gpu_and_rdma_pods_get_the_hca(rendered, variant):
    for _, template in pod_specs(rendered[variant]):
        for container in containers(template):
            program, args = parsed(container)
            if program == "epd-handshake":
                continue
            limits, requests = container["resources"]["limits"], container["resources"]["requests"]
            extended = {k for k in limits if "/" in k}
            assert {k: requests.get(k) for k in extended} == {k: limits[k] for k in extended}
            if program == "epd-encode-worker":
                assert limits["nvidia.com/gpu"] == 1
            rdma = variant.startswith("rdma") and runs_mooncake(container)
            assert ("rdma/rdma_shared_device_a" in limits) == rdma
            assert bool(args.mooncake_hca) == rdma
            assert args.mooncake_force_tcp == (1 if variant.startswith("tcp") and runs_mooncake(container) else 0)


# ---- ports ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_ports_agree_between_args_container_ports_probes_and_annotations(rendered, variant):
    for name, template in pod_specs(rendered[variant]):
        pod_ports = []
        metrics_ports = set()
        for container in containers(template):
            program, args = parsed(container)
            declared = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert declared == listening_ports(program, args), (name, container["name"])
            pod_ports += declared.values()
            metrics_ports.add(declared["bootstrap" if program == "epd-encode-worker" else "http"])
            paths = served_paths(program)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in container:
                    http = container[probe]["httpGet"]
                    assert port_number(http["port"], container) in declared.values()
                    assert http["path"] in paths, f"{program} serves no {http['path']}"
            if program in ("epd-encode-worker", "epd-prefill"):  # ready: a full table or pool says so
                assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
                assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert len(pod_ports) == len(set(pod_ports)), f"{name}: two containers listen on one port"
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
        assert int(annotations["prometheus.io/port"]) in metrics_ports


@pytest.mark.parametrize("variant", VARIANTS)
def test_services_reach_container_ports_of_the_pods_they_select(rendered, variant):
    templates = [template for _, template in pod_specs(rendered[variant])]
    for service in of_kind(rendered[variant], "Service"):
        spec = service["spec"]
        backends = [t for t in templates if selects({"matchLabels": spec["selector"]}, t["metadata"]["labels"])]
        assert backends, f"Service {service['metadata']['name']} selects no pods"
        for port in spec["ports"]:
            for template in backends:
                numbers = {port_number(port["targetPort"], c) for c in containers(template)
                           if isinstance(port["targetPort"], int) or
                           any(p.get("name") == port["targetPort"] for p in c["ports"])}
                assert numbers == {port["port"]}, (service["metadata"]["name"], port)


def test_dispatcher_discovers_ready_encoders_through_a_headless_service(rendered):
    for variant in VARIANTS:
        (service,) = [s for s in of_kind(rendered[variant], "Service") if s["metadata"]["name"] == "epd-encode-workers"]
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is False
        assert {p["name"] for p in service["spec"]["ports"]} == {"bootstrap", "intake"}
    assert "epd-encode-workers.<namespace>.svc.cluster.local" in (ROOT / "docs" / "deploy.md").read_text()


# ---- NetworkPolicies ---------------------------------------------------------------------------------

SOURCES = {  # who may knock: (namespace labels, pod labels)
    "dispatcher": (NAMESPACE, {"app.kubernetes.io/part-of": "epd", "app.kubernetes.io/component": "dispatcher"}),
    "prefill": (NAMESPACE, {"app.kubernetes.io/part-of": "epd", "app.kubernetes.io/component": "prefill"}),
    "encode": (NAMESPACE, {"app.kubernetes.io/part-of": "epd", "app.kubernetes.io/component": "encode"}),
    "monitoring": ({"kubernetes.io/metadata.name": "monitoring"}, {"app.kubernetes.io/name": "prometheus"}),
    "stranger": (NAMESPACE, {"app": "something-else"}),
}


def opens(entry, template, port: int) -> bool:
    """Whether a NetworkPolicy port entry covers TCP ``port`` of the pod ``template``."""
    if entry.get("protocol", "TCP") != "TCP":
        return False
    numbers = [port_number(entry["port"], c) for c in containers(template)
               if isinstance(entry["port"], int) or any(p.get("name") == entry["port"] for p in c["ports"])]
    return any(low <= port <= entry.get("endPort", low) for low in numbers)


def peer_admits(peer, namespace: dict, pod: dict) -> bool:
    assert "ipBlock" not in peer
    if "namespaceSelector" not in peer and namespace != NAMESPACE:
        return False  # a bare podSelector means pods of the policy's own namespace
    return selects(peer.get("namespaceSelector", {}), namespace) and selects(peer.get("podSelector", {}), pod)


def admitted(policies, template, port: int) -> set[str]:
    """The SOURCES that ingress NetworkPolicies let reach ``port`` of the pod ``template``."""
    labels = template["metadata"]["labels"]
    mine = [p for p in policies if selects(p["spec"]["podSelector"], labels) and "Ingress" in p["spec"]["policyTypes"]]
    assert mine, f"pod {labels} is selected by no NetworkPolicy: it is open to anyone"
    allowed = set()
    for rule in (rule for policy in mine for rule in policy["spec"].get("ingress", [])):
        if "ports" in rule and not any(opens(entry, template, port) for entry in rule["ports"]):
            continue
        allowed |= {source for source, (namespace, pod) in SOURCES.items()
                    if "from" not in rule or any(peer_admits(peer, namespace, pod) for peer in rule["from"])}
    return allowed


@pytest.mark.parametrize("variant", VARIANTS)
def test_network_policies_open_each_port_to_its_peers_only(rendered, variant):
    objects = rendered[variant]
    policies = of_kind(objects, "NetworkPolicy")
    colocated = variant.startswith("same-node")
    ((low, high),) = {mooncake_range(c) for _, t in pod_specs(objects) for c in containers(t)
                    if "MC_MIN_RPC_PORT" in container_env(c)}
    for _, template in pod_specs(objects):
        role = template["metadata"]["labels"]["app.kubernetes.io/component"]
        for container in containers(template):
            program, args = parsed(container)
            if program == "epd-encode-worker":
                expected = {"prefill", "dispatcher", "monitoring"} | ({"encode"} if colocated else set())
                assert admitted(policies, template, args.bootstrap_port) == expected
                assert admitted(policies, template, args.intake_port) == {"dispatcher"}
            elif program == "epd-prefill":
                assert admitted(policies, template, args.port) == {"dispatcher", "monitoring"}
            else:
                assert admitted(policies, template, args.port) == {"dispatcher", "prefill", "encode", "monitoring"}
            peer = {"encode": {"prefill"}, "prefill": {"encode"}}.get(role, set())
            expected = peer if any(runs_mooncake(c) for c in containers(template)) else set()
            for port in (low, high):
                assert admitted(policies, template, port) == expected, (role, port)
            assert admitted(policies, template, high + 1) == set()
            assert admitted(policies, template, low - 1) == set()


@pytest.mark.parametrize("variant", VARIANTS)
def test_mooncake_ports_are_pinned_to_the_range_the_policies_open(rendered, variant):
    objects = rendered[variant]
    ranges = {(entry["port"], entry["endPort"]) for policy in of_kind(objects, "NetworkPolicy")
              for rule in policy["spec"]["ingress"] for entry in rule.get("ports", []) if "endPort" in entry}
    engines = set()
    for _, template in pod_specs(objects):
        users = [c for c in containers(template) if runs_mooncake(c)]
        for container in users:
            low, high = mooncake_range(container)
            engines.add((low, high))
            assert high - low + 1 >= 2 * len(users), "each engine binds two ports: RPC and TCP data"
    assert ranges == engines, "policies must open exactly the pinned Mooncake range (none where nothing runs it)"


# ---- storage, secrets, shutdown ------------------------------------------------------------------------

def mounts(template, container):
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    return [(m, volumes[m["name"]]) for m in container.get("volumeMounts", [])]


@pytest.mark.parametrize("variant", VARIANTS)
def test_token_files_are_secret_keys_mounted_read_only(rendered, variant):
    for _, template in pod_specs(rendered[variant]):
        for container in containers(template):
            program, args = parsed(container)
            files = [args.token_file] + ([args.intake_token_file] if program == "epd-encode-worker" else [])
            for path in files:
                assert path, f"{program} runs without a token"
                (found,) = [(m, v) for m, v in mounts(template, container) if path.startswith(m["mountPath"] + "/")]
                mount, volume = found
                assert mount["readOnly"] is True and volume["secret"]["secretName"] == "epd-tokens"
                assert volume["secret"]["defaultMode"] & 0o077 <= 0o040, "token readable by its group at most"
                key_paths = {item["path"]: item["key"] for item in volume["secret"]["items"]}
                assert path[len(mount["mountPath"]) + 1:] in key_paths


@pytest.mark.parametrize("variant", VARIANTS)
def test_shm_and_memory_limits_hold_the_pools(rendered, variant):
    gib = 1 << 30
    for name, template in pod_specs(rendered[variant]):
        for container in containers(template):
            program, args = parsed(container)
            limit = memory_bytes(container["resources"]["limits"]["memory"])
            shm = 0
            for mount, volume in mounts(template, container):
                if mount["mountPath"] in ("/tmp", "/dev/shm"):
                    assert volume["emptyDir"]["sizeLimit"], "a bounded scratch volume"
                if mount["mountPath"] == "/dev/shm":
                    assert volume["emptyDir"]["medium"] == "Memory"
                    shm = memory_bytes(volume["emptyDir"]["sizeLimit"])
            if program == "epd-prefill":  # the receive pool is a /dev/shm segment this container creates
                assert args.pool_bytes <= shm - 256 * (1 << 20), name
                assert limit >= args.pool_bytes + gib
            if program == "epd-encode-worker":
                assert limit >= args.ring_bytes + args.cache_bytes + 8 * gib
                assert any(m["mountPath"] == "/models" and m["readOnly"] for m, _ in mounts(template, container))
                assert any(args.model.startswith(m["mountPath"] + "/") for m, _ in mounts(template, container))


def test_same_node_containers_share_one_memory_backed_dev_shm_as_one_user(rendered):
    for variant in ("same-node", "same-node+components"):
        (template,) = [t for n, t in pod_specs(rendered[variant]) if n == "epd-encode-worker"]
        programs = {parsed(c)[0]: c for c in containers(template)}
        assert set(programs) == {"epd-encode-worker", "epd-prefill"}
        shm_volumes = {v["name"] for c in programs.values() for m, v in mounts(template, c)
                       if m["mountPath"] == "/dev/shm"}
        assert len(shm_volumes) == 1
        assert all(parsed(c)[1].transports == "shm" for c in programs.values())
        assert all("runAsUser" not in c.get("securityContext", {}) for c in programs.values()), \
            "SHM segments are 0600 and owner-checked: both containers run as the pod's user"
        assert not [d for n, d in pod_specs(rendered[variant]) if n == "epd-prefill"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_graceful_termination_outlasts_in_flight_writes(rendered, variant):
    from encode_worker.worker import EncodeWorker
    from data_plane.mooncake import MooncakeConfig
    from prefill_side.receiver import ReceiverConfig

    join_s = EncodeWorker.stop.__defaults__[0]  # the worker's thread joins
    for _, template in pod_specs(rendered[variant]):
        for container in containers(template):
            program, args = parsed(container)
            if program != "epd-encode-worker":
                continue
            pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
            grace = template["spec"]["terminationGracePeriodSeconds"]
            assert grace >= pre_stop + join_s + args.write_timeout_s + 10
            # a receiver quarantines a failed slot longer than Mooncake may still write into it
            writer = MooncakeConfig(transfer_timeout_s=max(5, int(args.write_timeout_s)))
            assert ReceiverConfig(width=1).quarantine_s > writer.engine_timeout_s(args.ring_slot_bytes)


# ---- components ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.endswith("+components")])
def test_service_monitors_scrape_real_ports(rendered, variant):
    objects = rendered[variant]
    monitors = of_kind(objects, "ServiceMonitor")
    assert {m["apiVersion"] for m in monitors} == {"monitoring.coreos.com/v1"} and len(monitors) == 2
    services = of_kind(objects, "Service")
    for monitor in monitors:
        matched = [s for s in services if selects(monitor["spec"]["selector"], s["metadata"]["labels"])]
        assert matched, monitor["metadata"]["name"]
        for endpoint in monitor["spec"]["endpoints"]:
            assert set(endpoint) <= {"port", "path", "interval"} and endpoint["path"] == "/metrics"
            for service in matched:
                assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}


def test_hpa_scales_the_encoders_on_a_metric_they_export(rendered):
    from encode_worker import worker

    objects = rendered["tcp+components"]
    (hpa,) = of_kind(objects, "HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]["name"]
    (encode,) = [d for d in of_kind(objects, "Deployment") if d["metadata"]["name"] == target]
    assert "replicas" not in encode["spec"], "the HPA owns the replica count"
    (metric,) = hpa["spec"]["metrics"]
    assert f'"{metric["pods"]["metric"]["name"]}"' in Path(worker.__file__).read_text()
    (container,) = [c for c in containers(encode["spec"]["template"]) if parsed(c)[0] == "epd-encode-worker"]
    assert int(metric["pods"]["target"]["averageValue"]) < parsed(container)[1].queue_items, \
        "scale before intake refuses"
    (pdb,) = of_kind(objects, "PodDisruptionBudget")
    assert selects(pdb["spec"]["selector"], encode["spec"]["template"]["metadata"]["labels"])
    assert hpa["spec"]["minReplicas"] > pdb["spec"]["maxUnavailable"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_workload_selectors_match_their_own_pods(rendered, variant):
    for deployment in of_kind(rendered[variant], "Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selects(deployment["spec"]["selector"], labels)
        for constraint in deployment["spec"]["template"]["spec"].get("topologySpreadConstraints", []):
            assert selects(constraint["labelSelector"], labels)
    (encode,) = [d for d in of_kind(rendered[variant], "Deployment") if d["metadata"]["name"] == "epd-encode-worker"]
    assert len(encode["spec"]["template"]["spec"]["topologySpreadConstraints"]) == 2


# ---- the image ---------------------------------------------------------------------------------------------

def test_dockerfile_builds_what_the_manifests_run(rendered):
    text = (ROOT / "Dockerfile").read_text()
    (base,) = re.findall(r"^FROM (\S+)", text, re.M)
    assert re.search(r":[\w.-]+$", base) and not base.endswith(":latest")
    assert re.search(r"pip install [^\n]*\[gpu\]", text)
    assert "gpu" in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for package in ("libibverbs1", "ibverbs-providers", "librdmacm1"):
        assert re.search(rf"\b{package}\b", text)
    (user,) = re.findall(r"^USER (\d+)", text, re.M)
    commands = set()
    for variant in VARIANTS:
        for _, template in pod_specs(rendered[variant]):
            if template["spec"]["securityContext"].get("runAsNonRoot"):
                assert template["spec"]["securityContext"]["runAsUser"] == int(user)
            commands |= {c["command"][0] for c in containers(template)}
    assert commands <= set(SCRIPTS)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


# ---- the flag the manifests needed -------------------------------------------------------------------------

def test_prefill_offers_mooncake_at_its_mooncake_host(tmp_path):
    """epd-prefill advertises --mooncake-host in its offers (the manifests pass the pod IP)."""
    from handshake.app import create_app
    from handshake.rooms import RoomTable
    from handshake.server import ThreadedServer

    table = RoomTable()
    rooms = ThreadedServer(create_app(table)).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(ROOT), MC_LOG_LEVEL="ERROR", EPD_MOONCAKE_HOST="127.0.0.2")
    process = subprocess.Popen([sys.executable, "-m", "prefill_side.server", "--host", "127.0.0.1", "--port", str(port),
                                "--width", "8", "--transports", "mooncake", "--pool-bytes", str(1 << 20),
                                "--slot-bytes", str(1 << 16)], env=env, stderr=subprocess.DEVNULL)
    try:
        (room,) = table.mint(1, 30)
        body = json.dumps({"request_id": "r", "timeout_s": 3, "items": [{"offsets": [[0, 3]], "encode_handshake": {
            "bootstrap_room": room, "bootstrap_host": "127.0.0.1", "bootstrap_port": rooms.port}}]}).encode()
        sender = concurrent.futures.ThreadPoolExecutor(1)
        sent = sender.submit(_post_when_up, f"http://127.0.0.1:{port}", body)
        sender.shutdown(wait=False)
        end = time.monotonic() + 60
        while table.view(room).registration is None:
            assert time.monotonic() < end and process.poll() is None, "epd-prefill never registered the room"
            time.sleep(0.05)
        (offer,) = table.view(room).registration.offers
        assert offer.kind == "mooncake" and offer.session.startswith("127.0.0.2:")
        status, report = sent.result(timeout=30)  # nothing writes the room: the request times out
        assert status == 200 and report["state"] == "FAILED", (status, report)
    finally:
        process.terminate()
        process.wait(30)
        rooms.stop()


def _post_when_up(url: str, body: bytes) -> tuple[int, dict]:
    """POST ``body`` to /v1/prefill once the server answers /healthz (within 60 s, else the
    connection error); its status and report."""
    end = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/healthz", timeout=1).close()
            break
        except OSError:
            if time.monotonic() >= end:
                raise
            time.sleep(0.1)
    request = urllib.request.Request(f"{url}/v1/prefill", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status, json.loads(response.read())
