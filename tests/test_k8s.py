"""The Kubernetes manifests (k8s/) and the images (Dockerfile, Dockerfile.vllm), checked offline.

Every overlay, alone and with every optional component, is rendered with the venv's kubectl
(kustomize) and validated against the Kubernetes schemas (strict). Each container's command and
args go through the program's own parser, with the container's environment in place (and the
kubelet's $(VAR) expansion done), so a manifest cannot name a flag or an env value the program
does not take: the EPD programs' parsers, and for vLLM `vllm serve`'s own parser and checks, its
`--ec-transfer-config` as vLLM's ECTransferConfig, and that config's ec_connector_extra_config as
the EPD connector's ConnectorSettings. Ports, probes, Services, NetworkPolicies, Secrets and
memory sizes are checked against what the parsed programs do: the NetworkPolicies are evaluated
as a CNI enforces them and must allow exactly the flows the path needs (``FLOWS``), every pod
passes Pod Security "restricted" (k8s/namespace.yaml enforces it), rollouts and drains keep a
vLLM engine and a gateway serving, answers in flight finish within the grace period, GPU pods are
Guaranteed, and each container mounts the Secret keys it reads and no other.
"""

import concurrent.futures
import dataclasses
import functools
import importlib
import ipaddress
import json
import os
import re
import socket
import subprocess
import sys
import time
import tomllib
import types
import urllib.request
from fractions import Fraction
from pathlib import Path
from unittest import mock

import kubernetes_validate
import pytest
import yaml

from epdserve.dispatcher.workers import WorkerAddress
from epdserve.process_settings import ProcessSettings

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
KUBECTL = Path(sys.executable).parent / "kubectl"
OVERLAYS = {
    "base": "base",
    "tcp": "overlays/tcp",
    "rdma": "overlays/rdma",
    "same-node": "overlays/same-node",
    "tensor-parallel": "overlays/tensor-parallel",
}
COMPONENTS = [
    "components/servicemonitor",
    "components/hpa",
    "components/handshake",
    "components/grafana-dashboard",
]
VARIANTS = [*OVERLAYS, *(f"{name}+components" for name in OVERLAYS if name != "base")]
IMAGE = "ghcr.io/example-org/epd-encode-worker"  # ./Dockerfile: every EPD program
VLLM_IMAGE = "ghcr.io/example-org/epd-vllm"  # ./Dockerfile.vllm: vLLM with the EPD connector
RETAGGED = {
    IMAGE: "registry.example.com/epd/epd-encode-worker:0.1.1",  # an operator's `images:` entries
    VLLM_IMAGE: "registry.example.com/epd/epd-vllm:0.1.1",
}
VLLM = "vllm"  # the vLLM image's command
MIN_KUBERNETES = "1.30.0"  # the preStop `sleep` action (docs/deploy.md)
POD_IP = "10.1.2.3"  # what the downward API's status.podIP stands for here
NAMESPACE = {"kubernetes.io/metadata.name": "epd"}
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def _render(directory: Path) -> list[dict]:
    result = subprocess.run(
        [str(KUBECTL), "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    out = {name: _render(K8S / path) for name, path in OVERLAYS.items()}
    for name, path in OVERLAYS.items():
        if name == "base":
            continue
        work = tmp_path_factory.mktemp(
            name
        )  # an operator's overlay; kustomize takes relative paths only
        resources, components = (
            [os.path.relpath(K8S / target, work) for target in group]
            for group in ([path], COMPONENTS)
        )
        (work / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kustomize.config.k8s.io/v1beta1",
                    "kind": "Kustomization",
                    "resources": resources,
                    "components": components,
                    "images": [
                        {"name": name, "newName": new.split(":")[0], "newTag": new.split(":")[1]}
                        for name, new in RETAGGED.items()
                    ],
                }
            )
        )
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
    """Whether a label selector (matchLabels and matchExpressions, ANDed) selects ``labels``."""
    assert set(selector) <= {"matchLabels", "matchExpressions"}, selector
    operators = {
        "In": lambda key, values: labels.get(key) in values,
        "NotIn": lambda key, values: labels.get(key) not in values,
        "Exists": lambda key, values: key in labels,
        "DoesNotExist": lambda key, values: key not in labels,
    }
    return all(
        labels.get(key) == value for key, value in selector.get("matchLabels", {}).items()
    ) and all(
        operators[e["operator"]](e["key"], e.get("values", []))
        for e in selector.get("matchExpressions", [])
    )


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


def expanded(arg: str, env: dict[str, str]) -> str:
    """``arg`` (of a command or args) as the kubelet passes it: each $(VAR) replaced by the
    container's env VAR (an undefined one would stay literal: refused here), ``$$`` by ``$``."""

    def value(match):
        if match.group(0) == "$$":
            return "$"
        assert match.group(1) in env, (
            f"$({match.group(1)}) in {arg!r} names no env of the container"
        )
        return env[match.group(1)]

    return re.sub(r"\$\$|\$\((\w+)\)", value, arg)


SHELL = ["/bin/sh", "-c"]


def launched(container) -> tuple[str, str | None, list[str]]:
    """(program, shell script or None, args) as the container starts them: the program itself,
    or ``/bin/sh -c SCRIPT PROGRAM`` whose script ends by exec'ing it with the args ("$@")."""
    env = container_env(container)
    command = [expanded(part, env) for part in container["command"]]
    args = [expanded(arg, env) for arg in container.get("args", [])]
    if command[: len(SHELL)] == SHELL:
        script, program = command[len(SHELL) :]
        assert script.rstrip().endswith(f'exec {program} "$@"'), script
        return program, script, args
    (program,) = command
    return program, None, args


def file_read_by(script: str) -> str:
    """The one file a wrapper script reads (``$(cat FILE)``)."""
    (path,) = re.findall(r"\$\(cat (\S+)\)", script)
    return path


def parsed(container):
    """The container's command + args through the program's own parser, under its env."""
    program, _, args = launched(container)
    env = container_env(container)
    if program == VLLM:
        return VLLM, vllm_serve(tuple(args))
    assert program in SCRIPTS, f"{program} is not one of the console scripts {SCRIPTS}"
    module = importlib.import_module(SCRIPTS[program].split(":")[0])
    (settings,) = [
        value
        for value in vars(module).values()
        if isinstance(value, type)
        and issubclass(value, ProcessSettings)
        and getattr(value, "PROG", None) == program
    ]
    # the token files are secrets mounted in the cluster only: read as their path here
    with (
        mock.patch.dict(os.environ, env, clear=True),
        mock.patch(
            "epdserve.process_settings.secrets.handshake_token",
            lambda path: path and f"token in {path}",
        ),
        mock.patch(
            "epdserve.process_settings.secrets.read_secret", lambda path, flag: f"token in {path}"
        ),
        mock.patch(  # the gateway's API keys
            "epdserve.gateway.settings.read_secret", lambda path, flag: f"key in {path}"
        ),
    ):
        return program, settings.from_command_line(args)


@functools.cache
def vllm_serve(args: tuple[str, ...]):
    """``vllm <args>`` through the vLLM CLI's `serve` parser and its checks, as the image's `vllm`
    runs them; ``.connector``: the ec_connector_extra_config as the EPD connector reads it."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from prefill_side.vllm_connector import ConnectorSettings

    parser = FlexibleArgumentParser(prog=VLLM)
    serve = ServeSubcommand()
    serve.subparser_init(parser.add_subparsers(dest="subparser", required=True))
    namespace = parser.parse_args(list(args))
    assert namespace.subparser == serve.name, args
    serve.validate(namespace)
    namespace.connector = ConnectorSettings.model_validate(
        namespace.ec_transfer_config.ec_connector_extra_config
    )
    return namespace


def transports(program, args) -> list[str]:
    if program == VLLM:
        return list(args.connector.transports)
    return list(getattr(args, "transports", ()))


def mooncake_choices(program, args) -> tuple[str, bool]:
    """(HCA list, forced TCP) of a program that runs Mooncake."""
    if program == VLLM:
        return args.connector.mooncake_ib_device, args.connector.mooncake_force_tcp
    return args.mooncake_ib_device, bool(args.mooncake_force_tcp)


def token_files(container) -> list[str]:
    """Every secret file the container reads: its tokens and API keys."""
    program, script, _ = launched(container)
    args = parsed(container)[1]
    if program == VLLM:  # the handshake token; the API key, through the wrapper
        return [args.connector.handshake_token_file, file_read_by(script)]
    if program == "epd-gateway":
        return [
            args.token_file,
            args.intake_token_file,
            args.api_key_file,
            args.vllm_api_key_file,
        ]
    if program == "epd-encode-worker":
        return [args.token_file, args.intake_token_file]
    return [args.token_file]


def listening_ports(program, args) -> dict[str, int]:
    if program == "epd-encode-worker":
        return {"bootstrap": args.bootstrap_port, "intake": args.intake_port}
    if program == VLLM:  # vLLM's API, and the receiver's metrics in vLLM's EngineCore
        return {"vllm": args.port, "epd-metrics": args.connector.http_port}
    return {"http": args.port}


def http_port_names(program) -> set[str]:
    """The container ports, by name, that serve ``program``'s /metrics."""
    return {"epd-encode-worker": {"bootstrap"}, VLLM: {"vllm", "epd-metrics"}}.get(
        program, {"http"}
    )


def mooncake_range(container) -> tuple[int, int]:
    env = container_env(container)
    return int(env["MC_MIN_RPC_PORT"]), int(env["MC_MAX_RPC_PORT"])


def runs_mooncake(container) -> bool:
    return "mooncake" in transports(*parsed(container))


def served_paths(program, args) -> set[str]:
    if program == VLLM:
        from vllm.entrypoints.launchers.app import build_app

        app = build_app(args, ("generate",))
    elif program == "epd-gateway":
        from epdserve.gateway.app import build_app

        # the routes its settings give (/docs only with --docs); the rest of the gateway
        # object is used when serving
        app = build_app(types.SimpleNamespace(settings=args))
    else:  # the encode worker serves the handshake app on its bootstrap port
        from handshake.app import create_app

        app = create_app()
    return {route.path for route in app.routes}


def memory_bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "": 1}
    number, unit = re.fullmatch(r"(\d+)([KMG]i)?", quantity).groups()
    return int(number) * units[unit or ""]


def amount(quantity) -> Fraction:
    """A Kubernetes resource quantity as a number (cpu "500m" = 1/2, memory "1Gi" = 2**30)."""
    units = {"m": Fraction(1, 1000), "": 1, "k": 10**3, "M": 10**6, "G": 10**9}
    units |= {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    number, unit = re.fullmatch(r"(\d+)(m|k|M|G|Ki|Mi|Gi|Ti)?", str(quantity)).groups()
    return int(number) * Fraction(units[unit or ""])


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


def test_one_images_entry_per_image_retags_every_container(rendered):
    for variant in VARIANTS:
        for _, template in pod_specs(rendered[variant]):
            for container in containers(template):
                image = VLLM_IMAGE if launched(container)[0] == VLLM else IMAGE
                expected = RETAGGED[image] if variant.endswith("+components") else f"{image}:0.1.0"
                assert container["image"] == expected, container["name"]


def test_components_add_what_they_promise(rendered):
    kinds = {o["kind"] for o in rendered["tcp+components"]} - {o["kind"] for o in rendered["tcp"]}
    assert kinds == {"ServiceMonitor", "HorizontalPodAutoscaler", "ConfigMap"}
    names = {o["metadata"]["name"] for o in of_kind(rendered["tcp+components"], "Deployment")}
    assert names == {"epd-encode-worker", "epd-prefill", "epd-gateway", "epd-handshake"}
    (dashboard,) = [  # the Grafana sidecar finds it by its label; the JSON is the file as it is
        o for o in of_kind(rendered["tcp+components"], "ConfigMap") if "grafana_dashboard" in str(o)
    ]
    assert dashboard["metadata"]["labels"] == {"grafana_dashboard": "1"}
    shipped = (K8S / "components" / "grafana-dashboard" / "epd-dashboard.json").read_text()
    assert json.loads(dashboard["data"]["epd-dashboard.json"]) == json.loads(shipped)


# ---- containers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_command_parses_with_the_programs_own_parser(rendered, variant):
    programs = set()
    for _, template in pod_specs(rendered[variant]):
        for container in containers(template):
            program, args = parsed(container)
            programs.add(program)
            if program == "epd-encode-worker":
                assert args.host == POD_IP, (
                    "peers reach the worker at --host: it must be the pod IP"
                )
                assert args.device.startswith("cuda") and args.bind == "0.0.0.0"
            if program == VLLM and "mooncake" in args.connector.transports:
                assert args.connector.mooncake_host == POD_IP, (
                    "encode workers write to mooncake_host: the pod IP"
                )
    assert {"epd-encode-worker", VLLM, "epd-gateway"} <= programs


@pytest.mark.parametrize("variant", VARIANTS)
def test_vllm_loads_the_epd_connector_as_a_consumer(rendered, variant):
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    from prefill_side.vllm_connector import EPDConnector

    engines = [
        (args, container)
        for _, t in pod_specs(rendered[variant])
        for container in containers(t)
        for program, args in [parsed(container)]
        if program == VLLM
    ]
    assert engines
    for args, container in engines:
        config = args.ec_transfer_config
        assert config.is_ec_consumer and not config.is_ec_producer
        assert config.ec_connector_module_path == EPDConnector.__module__
        assert ECConnectorFactory.get_connector_class(config) is EPDConnector
        assert list(args.connector.transports) == (
            ["shm"] if variant.startswith("same-node") else ["mooncake"]
        )
        ranks = args.tensor_parallel_size * args.pipeline_parallel_size
        assert ranks == (4 if variant.startswith("tensor-parallel") else 1)
        assert container["resources"]["limits"]["nvidia.com/gpu"] == ranks, "one GPU per rank"


def _service_port(objects, url: str, template) -> int | None:
    """The container port of ``template`` that ``url`` reaches: through a Service of that name
    selecting the pod, or over loopback inside the pod."""
    host, port = re.fullmatch(r"http://([\w.-]+):(\d+)", url).groups()
    if host == "127.0.0.1":
        return int(port)
    for service in of_kind(objects, "Service"):
        if service["metadata"]["name"] == host and selects(
            {"matchLabels": service["spec"]["selector"]}, template["metadata"]["labels"]
        ):
            (entry,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
            (number,) = {
                port_number(entry["targetPort"], c)
                for c in containers(template)
                if any(p.get("name") == entry["targetPort"] for p in c["ports"])
            }
            return number
    return None


@pytest.mark.parametrize("variant", VARIANTS)
def test_gateway_reaches_vllm_and_the_encoders_and_all_three_serve_one_checkpoint(
    rendered, variant
):
    objects = rendered[variant]
    colocated = variant.startswith("same-node")
    gateways = []
    for _, template in pod_specs(objects):
        by_program = dict(map(parsed, containers(template)))
        if "epd-gateway" in by_program:
            gateways.append((template, by_program["epd-gateway"]))
    assert gateways
    workers = [
        args
        for _, t in pod_specs(objects)
        for program, args in map(parsed, containers(t))
        if program == "epd-encode-worker"
    ]
    engines = [
        (t, args)
        for _, t in pod_specs(objects)
        for program, args in map(parsed, containers(t))
        if program == VLLM
    ]
    (model,) = {w.model for w in workers}
    (name,) = {w.served_model_name or os.path.basename(model) for w in workers}
    (dtype,) = {w.dtype for w in workers}
    for _, engine in engines:
        assert engine.model_tag == model and engine.dtype == dtype, (
            "the workers' rows are vLLM's rows"
        )
        assert engine.served_model_name == [name], (
            "what clients send as `model`, the gateway's name too"
        )
    for template, gateway in gateways:
        assert gateway.model == model
        assert gateway.limit_mm_per_prompt is None and not gateway.mm_processor_kwargs, (
            "the gateway takes vLLM's limits and processor settings from vLLM (--engine-url)"
        )
        assert (gateway.served_model_name or os.path.basename(gateway.model)) == name, (
            "intake refuses other names"
        )
        # vLLM: the same pod's (same-node, loopback) or the epd-prefill Service's
        local = [(t, e) for t, e in engines if t is template]
        reached = [
            e
            for t, e in (local if colocated else engines)
            if _service_port(objects, gateway.vllm_url, t) == e.port
        ]
        assert reached and len(reached) == len(local if colocated else engines), gateway.vllm_url
        assert bool(local) == colocated and ("127.0.0.1" in gateway.vllm_url) == colocated
        described = [  # and the same engines' connectors describe what they run
            e
            for t, e in (local if colocated else engines)
            if _service_port(objects, gateway.engine_url, t) == e.connector.http_port
        ]
        assert len(described) == len(reached), gateway.engine_url
        # the encode workers: its own pod's only (SHM reaches no other pod), else the headless
        # Service
        if colocated:
            assert (gateway.workers, gateway.dns) == ((WorkerAddress("127.0.0.1"),), None)
            (worker,) = [
                a
                for program, a in map(parsed, containers(template))
                if program == "epd-encode-worker"
            ]
        else:
            assert (gateway.workers, gateway.dns) == ((), "epd-encode-workers")
            (worker,) = {(w.bootstrap_port, w.intake_port): w for w in workers}.values()
        assert (gateway.bootstrap_port, gateway.intake_port) == (
            worker.bootstrap_port,
            worker.intake_port,
        )


@pytest.mark.parametrize("variant", VARIANTS)
def test_images_are_pinned_and_every_container_is_bounded_and_unprivileged(rendered, variant):
    for name, template in pod_specs(rendered[variant]):
        spec = template["spec"]
        assert spec["automountServiceAccountToken"] is False
        # Service links inject EPD_PREFILL_PORT=tcp://... and EPD_HANDSHAKE_PORT=tcp://..., which
        # the programs read as their own --port defaults.
        assert spec["enableServiceLinks"] is False, name
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in containers(template):
            image = container["image"]
            assert "@sha256:" in image or re.search(r":[\w.-]+$", image.rsplit("/", 1)[-1]), image
            assert not image.endswith(":latest"), image
            resources = container["resources"]
            for kind in ("cpu", "memory"):
                assert kind in resources["requests"] and kind in resources["limits"], (
                    name,
                    container["name"],
                )
            assert memory_bytes(resources["requests"]["memory"]) <= memory_bytes(
                resources["limits"]["memory"]
            )
            security = container["securityContext"]
            assert (
                security["allowPrivilegeEscalation"] is False
                and security["readOnlyRootFilesystem"] is True
            )
            # no capability at all, RDMA included (its locked-memory limit is the runtime's)
            assert security["capabilities"] == {"drop": ["ALL"]}, (name, container["name"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_encode_workers_get_a_gpu_and_rdma_pods_get_the_hca(rendered, variant):
    for _, template in pod_specs(rendered[variant]):
        for container in containers(template):
            program, args = parsed(container)
            limits, requests = container["resources"]["limits"], container["resources"]["requests"]
            extended = {k for k in limits if "/" in k}
            assert {k: requests.get(k) for k in extended} == {k: limits[k] for k in extended}
            # vLLM: one per rank (test_vllm_loads_the_epd_connector_as_a_consumer)
            if program != VLLM:
                gpus = 1 if program == "epd-encode-worker" else None
                assert limits.get("nvidia.com/gpu") == gpus
            if program in ("epd-handshake", "epd-gateway"):
                continue
            rdma = variant.startswith("rdma") and runs_mooncake(container)
            assert ("rdma/rdma_shared_device_a" in limits) == rdma
            hca, force_tcp = mooncake_choices(program, args)
            assert bool(hca) == rdma
            assert force_tcp == (variant.startswith("tcp") and runs_mooncake(container))


# ---- Pod Security Admission ----------------------------------------------------------------------

NAMESPACE_FILE = K8S / "namespace.yaml"
# The Pod Security Standards' "restricted" profile (which includes "baseline"), as Kubernetes 1.30
# enforces it: https://kubernetes.io/docs/concepts/security/pod-security-standards/
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {
    None,
    "",
    "container_t",
    "container_init_t",
    "container_kvm_t",
    "container_engine_t",
}
CONFINED = {"RuntimeDefault", "Localhost"}


def restricted_violations(template) -> list[str]:
    """What keeps the pod ``template`` out of Pod Security "restricted" (empty: it passes)."""
    spec = template["spec"]
    pod = spec.get("securityContext", {})
    found = [key for key in ("hostNetwork", "hostPID", "hostIPC") if spec.get(key)]
    found += [
        f"volume {v['name']}: {sorted(set(v) - {'name'})}"
        for v in spec.get("volumes", [])
        if not set(v) - {"name"} <= RESTRICTED_VOLUMES
    ]
    found += [
        f"sysctl {s['name']}" for s in pod.get("sysctls", []) if s["name"] not in SAFE_SYSCTLS
    ]
    if pod.get("runAsUser") == 0:
        found.append("pod runAsUser 0")
    if pod.get("windowsOptions", {}).get("hostProcess"):
        found.append("hostProcess")
    annotations = template["metadata"].get("annotations", {})
    for key, value in annotations.items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/"):
            if value != "runtime/default" and not value.startswith("localhost/"):
                found.append(f"AppArmor {value}")
    for container in (
        spec.get("initContainers", []) + spec["containers"] + spec.get("ephemeralContainers", [])
    ):
        name, own = container["name"], container.get("securityContext", {})

        def setting(key, default=None):
            return own.get(key, pod.get(key, default))

        if own.get("privileged"):
            found.append(f"{name}: privileged")
        if own.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation not false")
        if setting("runAsNonRoot") is not True:
            found.append(f"{name}: runAsNonRoot not true")
        if own.get("runAsUser") == 0:
            found.append(f"{name}: runAsUser 0")
        if setting("seccompProfile", {}).get("type") not in CONFINED:
            found.append(f"{name}: seccomp not RuntimeDefault or Localhost")
        if setting("appArmorProfile", {}).get("type", "RuntimeDefault") not in CONFINED:
            found.append(f"{name}: AppArmor unconfined")
        selinux = setting("seLinuxOptions", {})
        if selinux.get("type") not in SELINUX_TYPES or {"user", "role"} & set(selinux):
            found.append(f"{name}: SELinux options")
        if own.get("procMount", "Default") != "Default":
            found.append(f"{name}: procMount")
        capabilities = own.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"{name}: capabilities not dropped (ALL)")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: adds {capabilities['add']}")
        found += [
            f"{name}: hostPort {p['hostPort']}"
            for p in container.get("ports", [])
            if p.get("hostPort")
        ]
    return found


def test_the_namespace_enforces_restricted_and_is_applied_apart_from_the_overlays(rendered):
    (namespace,) = yaml.safe_load_all(NAMESPACE_FILE.read_text())
    for version in (MIN_KUBERNETES, kubernetes_validate.latest_version() + ".0"):
        kubernetes_validate.validate(namespace, version, strict=True)
    assert namespace["metadata"]["name"] == NAMESPACE["kubernetes.io/metadata.name"]
    labels = namespace["metadata"]["labels"]
    for mode in ("enforce", "audit", "warn"):
        assert labels[f"pod-security.kubernetes.io/{mode}"] == "restricted"
    assert labels["pod-security.kubernetes.io/enforce-version"] == "v" + MIN_KUBERNETES[:4]
    for variant in VARIANTS:  # namespaced objects only: `kubectl -n <ns> apply -k` places them
        assert not of_kind(rendered[variant], "Namespace")
        assert all("namespace" not in o["metadata"] for o in rendered[variant])
    # the docs apply the file, or label an existing namespace alike
    docs = (ROOT / "docs" / "deploy.md").read_text()
    assert "kubectl apply -f k8s/namespace.yaml" in docs
    (command,) = re.findall(r"kubectl label --overwrite namespace epd(?:[^\n]*\\\n)+[^\n]*", docs)
    assert dict(re.findall(r"(pod-security\.kubernetes\.io/[\w-]+)=([\w.]+)", command)) == labels


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_pod_passes_pod_security_restricted(rendered, variant):
    for name, template in pod_specs(rendered[variant]):
        assert restricted_violations(template) == [], name


def test_the_restricted_check_refuses_what_restricted_refuses(rendered):
    (template,) = [t for n, t in pod_specs(rendered["rdma"]) if n == "epd-encode-worker"]

    def changed(change):
        copy = json.loads(json.dumps(template))
        change(copy["spec"], copy["spec"]["containers"][0])
        return restricted_violations(copy)

    def root_with_ipc_lock(pod, container):  # what the RDMA overlay used to be
        pod["securityContext"] |= {"runAsNonRoot": False, "runAsUser": 0}
        container["securityContext"]["capabilities"]["add"] = ["IPC_LOCK"]

    assert len(changed(root_with_ipc_lock)) == 3
    assert changed(lambda pod, c: pod.update(hostNetwork=True)) == ["hostNetwork"]
    assert changed(lambda pod, c: pod["volumes"].append({"name": "h", "hostPath": {"path": "/"}}))
    assert changed(lambda pod, c: c["ports"][0].update(hostPort=8990))
    assert changed(lambda pod, c: c["securityContext"].update(privileged=True))
    assert changed(lambda pod, c: c["securityContext"].pop("allowPrivilegeEscalation"))
    assert changed(lambda pod, c: c["securityContext"].update(capabilities={}))
    assert changed(lambda pod, c: pod["securityContext"].pop("seccompProfile"))
    assert changed(lambda pod, c: pod["securityContext"].pop("runAsNonRoot"))
    assert not changed(
        lambda pod, c: c["securityContext"]["capabilities"].update(add=["NET_BIND_SERVICE"])
    )


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
            metrics_ports |= {declared[port] for port in http_port_names(program)}
            paths = served_paths(program, args)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in container:
                    http = container[probe]["httpGet"]
                    assert port_number(http["port"], container) in declared.values()
                    assert http["path"] in paths, f"{program} serves no {http['path']}"
            probed = {
                probe: container[probe]["httpGet"]["path"]
                for probe in ("readinessProbe", "livenessProbe")
            }
            if program == "epd-encode-worker":  # ready: a full table says so
                assert probed == {"readinessProbe": "/readyz", "livenessProbe": "/healthz"}
            if program == VLLM:  # 503 once the engine is dead
                assert probed == {"readinessProbe": "/health", "livenessProbe": "/health"}
            if program == "epd-gateway":  # ready: vLLM's /health is 200
                assert probed == {"readinessProbe": "/readyz", "livenessProbe": "/health"}
                assert not {"/docs", "/openapi.json"} & paths, "no API docs on the public port"
        assert len(pod_ports) == len(set(pod_ports)), f"{name}: two containers listen on one port"
        annotations = template["metadata"]["annotations"]
        assert (
            annotations["prometheus.io/scrape"] == "true"
            and annotations["prometheus.io/path"] == "/metrics"
        )
        assert int(annotations["prometheus.io/port"]) in metrics_ports


@pytest.mark.parametrize("variant", VARIANTS)
def test_services_reach_container_ports_of_the_pods_they_select(rendered, variant):
    templates = [template for _, template in pod_specs(rendered[variant])]
    for service in of_kind(rendered[variant], "Service"):
        spec = service["spec"]
        backends = [
            t
            for t in templates
            if selects({"matchLabels": spec["selector"]}, t["metadata"]["labels"])
        ]
        assert backends, f"Service {service['metadata']['name']} selects no pods"
        for port in spec["ports"]:
            for template in backends:
                numbers = {
                    port_number(port["targetPort"], c)
                    for c in containers(template)
                    if isinstance(port["targetPort"], int)
                    or any(p.get("name") == port["targetPort"] for p in c["ports"])
                }
                assert numbers == {port["port"]}, (service["metadata"]["name"], port)


def test_dispatcher_discovers_ready_encoders_through_a_headless_service(rendered):
    for variant in VARIANTS:
        (service,) = [
            s
            for s in of_kind(rendered[variant], "Service")
            if s["metadata"]["name"] == "epd-encode-workers"
        ]
        assert (
            service["spec"]["clusterIP"] == "None"
            and service["spec"]["publishNotReadyAddresses"] is False
        )
        assert {p["name"] for p in service["spec"]["ports"]} == {"bootstrap", "intake"}
    assert (
        "epd-encode-workers.<namespace>.svc.cluster.local"
        in (ROOT / "docs" / "deploy.md").read_text()
    )


# ---- NetworkPolicies -----------------------------------------------------------------------------

MONITORING = {"kubernetes.io/metadata.name": "monitoring"}
PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}  # the Prometheus Operator's pods


@dataclasses.dataclass(eq=False)
class Peer:
    """One end of a connection: a pod (its namespace's labels and its own; ``programs``: what a
    pod of ours runs, each program's parsed settings and container) or an address outside the
    cluster (no labels, ``namespace`` None)."""

    name: str
    address: str
    namespace: dict | None = None
    labels: dict | None = None
    programs: dict = dataclasses.field(default_factory=dict)

    @property
    def ours(self) -> bool:
        return self.namespace == NAMESPACE


OUTSIDE = [  # every peer outside the namespace the tests try
    Peer("client", "10.2.0.7", {"kubernetes.io/metadata.name": "ingress"}, {"app": "ingress"}),
    Peer("prometheus", "10.2.0.8", MONITORING, PROMETHEUS),
    Peer("grafana", "10.2.0.9", MONITORING, {"app.kubernetes.io/name": "grafana"}),
    Peer(
        "kube-dns",
        "10.2.0.10",
        {"kubernetes.io/metadata.name": "kube-system"},
        {"k8s-app": "kube-dns"},
    ),
    # a pod of another namespace carrying the dispatcher's labels
    Peer(
        "impostor",
        "10.2.0.11",
        {"kubernetes.io/metadata.name": "other"},
        {"app.kubernetes.io/part-of": "epd", "app.kubernetes.io/component": "dispatcher"},
    ),
    Peer("public IPv4", "93.184.215.14"),
    Peer("public IPv6", "2606:2800:21f:cb07:6820:80da:af6b:8b2c"),
    *(
        Peer(address, address)
        for address in (
            "10.0.0.1",
            "172.16.0.1",
            "192.168.0.1",
            "100.64.0.1",  # CGNAT
            "127.0.0.1",
            "0.0.0.1",
            "169.254.169.254",  # cloud metadata
            "::1",
            "fd00::1",
            "fe80::1",
            "::ffff:10.0.0.1",
            "::ffff:169.254.169.254",
            "fd00:ec2::254",  # AWS's metadata over IPv6
        )
    ),
]
# A pod of the namespace that is none of ours: the default deny leaves it nothing.
STRANGER = Peer("stranger", "10.1.9.9", NAMESPACE, {"app": "something-else"})

# Every connection the path needs, written once: (from, to, port): why. A program names the pods
# that run it (same-node: one pod runs three, which talk over loopback: no flow); "anyone" is every
# peer outside the namespace; "every EPD pod" is each of ours. A port is the receiving program's
# container port by name, or "mooncake" (its pinned Mooncake range, where it runs Mooncake), "dns"
# (UDP and TCP 53) or "web" (TCP 80 and 443). Nothing else may pass: tests below.
FLOWS = {
    ("anyone", "epd-gateway", "http"): "clients call the OpenAI API (Prometheus its /metrics)",
    ("epd-gateway", "epd-encode-worker", "bootstrap"): "the gateway opens rooms, reads /readyz",
    ("epd-gateway", "epd-encode-worker", "intake"): "the gateway sends the items",
    ("epd-gateway", VLLM, "vllm"): "chat requests, vLLM's /health",
    ("epd-gateway", VLLM, "epd-metrics"): "/v1/engine: what vLLM runs",
    (VLLM, "epd-encode-worker", "bootstrap"): "the connector registers each room's slots",
    ("epd-encode-worker", VLLM, "mooncake"): "the rows, written into the receive pool",
    (VLLM, "epd-encode-worker", "mooncake"): "Mooncake's RDMA set-up calls the writer back",
    ("epd-gateway", "epd-handshake", "http"): "rooms at the standalone room service",
    ("epd-encode-worker", "epd-handshake", "http"): "the workers' room streams",
    (VLLM, "epd-handshake", "http"): "the connector registers the rooms there",
    ("prometheus", "epd-encode-worker", "bootstrap"): "the encoder's /metrics",
    ("prometheus", VLLM, "vllm"): "vLLM's /metrics",
    ("prometheus", VLLM, "epd-metrics"): "the receiver's /metrics",
    ("prometheus", "epd-handshake", "http"): "the room service's /metrics",
    ("every EPD pod", "kube-dns", "dns"): "Service names, the hosts of image URLs",
    ("epd-gateway", "internet", "web"): "image and video URLs",
}


def our_pods(objects) -> list[Peer]:
    return [
        Peer(
            name,
            f"10.1.0.{index}",
            NAMESPACE,
            template["metadata"]["labels"],
            {program: (args, c) for c in containers(template) for program, args in [parsed(c)]},
        )
        for index, (name, template) in enumerate(pod_specs(objects), start=1)
    ]


def members(role: str, pods: list[Peer]) -> list[Peer]:
    if role == "anyone":
        return list(OUTSIDE)
    if role == "every EPD pod":
        return pods
    if role == "internet":
        return [peer for peer in OUTSIDE if peer.name.startswith("public ")]
    named = [peer for peer in OUTSIDE if peer.name == role]
    return named or [pod for pod in pods if role in pod.programs]


def flow_ports(port: str, role: str, target: Peer) -> list[tuple[str, int]]:
    """(protocol, number) of the ``port`` of ``role`` at ``target``."""
    if port == "dns":
        return [("UDP", 53), ("TCP", 53)]
    if port == "web":
        return [("TCP", 80), ("TCP", 443)]
    args, container = target.programs[role]
    if port == "mooncake":
        if not runs_mooncake(container):
            return []
        low, high = mooncake_range(container)
        return [("TCP", number) for number in range(low, high + 1)]
    return [("TCP", listening_ports(role, args)[port])]


def needed(pods: list[Peer]) -> dict[tuple[str, str, str, int], str]:
    """Every (from, to, protocol, port) the path needs among ``pods`` and OUTSIDE, and why."""
    out = {}
    for (source, target, port), why in FLOWS.items():
        for sender in members(source, pods):
            for receiver in members(target, pods):
                if sender is receiver:  # one pod: loopback; replicas never call each other
                    continue
                for protocol, number in flow_ports(port, target, receiver):
                    out[(sender.name, receiver.name, protocol, number)] = why
    return out


def peer_matches(peer: dict, other: Peer) -> bool:
    """Whether a NetworkPolicy peer (from/to entry) covers ``other``."""
    if "ipBlock" in peer:
        address, block = ipaddress.ip_address(other.address), peer["ipBlock"]
        return address in ipaddress.ip_network(block["cidr"]) and not any(
            address in ipaddress.ip_network(excepted) for excepted in block.get("except", [])
        )
    if other.namespace is None:  # outside the cluster: no labels to select it by
        return False
    if "namespaceSelector" in peer:
        in_namespace = selects(peer["namespaceSelector"], other.namespace)
    else:  # a bare podSelector selects in the policy's own namespace
        in_namespace = other.ours
    return in_namespace and selects(peer.get("podSelector", {}), other.labels)


def ports_cover(entries: list | None, protocol: str, port: int) -> bool:
    if not entries:
        return True
    for entry in entries:
        assert isinstance(entry.get("port", 0), int), f"named ports are not evaluated: {entry}"
    return any(
        entry.get("protocol", "TCP") == protocol
        and ("port" not in entry or entry["port"] <= port <= entry.get("endPort", entry["port"]))
        for entry in entries
    )


def allows(policies, direction: str, pod: Peer, other: Peer, protocol: str, port: int) -> bool:
    """Whether the policies selecting ``pod`` let it send to (Egress) or take from (Ingress)
    ``other`` on the receiver's ``protocol`` ``port``. A pod no policy selects is open."""
    if not pod.ours:
        return True  # its own namespace's business
    mine = [
        policy
        for policy in policies
        if direction in policy["spec"]["policyTypes"]
        and selects(policy["spec"]["podSelector"], pod.labels)
    ]
    rules_key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    return not mine or any(
        ports_cover(rule.get("ports"), protocol, port)
        and (not rule.get(peers_key) or any(peer_matches(p, other) for p in rule[peers_key]))
        for policy in mine
        for rule in policy["spec"].get(rules_key, [])
    )


def allowed_flows(objects) -> set[tuple[str, str, str, int]]:
    """Every (from, to, protocol, port) the NetworkPolicies let pass, among our pods, STRANGER and
    OUTSIDE, on every port a container declares, a policy names (and one past each end of its
    ranges) and a few common ones."""
    policies = of_kind(objects, "NetworkPolicy")
    for policy in policies:
        assert {"Ingress", "Egress"} >= set(policy["spec"]["policyTypes"]) > set(), policy
    numbers = {22, 53, 80, 443, 6443, 8080}
    for _, template in pod_specs(objects):
        numbers |= {p["containerPort"] for c in containers(template) for p in c.get("ports", [])}
    for policy in policies:
        for rule in policy["spec"].get("ingress", []) + policy["spec"].get("egress", []):
            for entry in rule.get("ports", []):
                low = entry.get("port", 1)
                numbers |= set(range(low - 1, entry.get("endPort", low) + 2))
    everyone = our_pods(objects) + [STRANGER] + OUTSIDE
    return {
        (sender.name, receiver.name, protocol, number)
        for sender in everyone
        for receiver in everyone
        if sender.ours or receiver.ours
        for protocol in ("TCP", "UDP")
        for number in numbers
        if allows(policies, "Egress", sender, receiver, protocol, number)
        and allows(policies, "Ingress", receiver, sender, protocol, number)
    }


def flow_differences(objects) -> tuple[set, set]:
    """(allowed but not needed, needed but not allowed)."""
    allowed, wanted = allowed_flows(objects), needed(our_pods(objects))
    return allowed - wanted.keys(), wanted.keys() - allowed


@pytest.mark.parametrize("variant", VARIANTS)
def test_network_policies_allow_exactly_the_flows_the_path_needs(rendered, variant):
    extra, missing = flow_differences(rendered[variant])
    assert not extra, f"allowed, and no flow of FLOWS: {sorted(extra)[:20]}"
    assert not missing, f"needed, and not allowed: {sorted(missing)[:20]}"


def _without(objects, change):
    """A deep copy of ``objects`` with ``change`` applied to each NetworkPolicy."""
    copy = json.loads(json.dumps(objects))
    for policy in of_kind(copy, "NetworkPolicy"):
        change(policy)
    return copy


def test_the_flow_check_fails_on_a_policy_too_open_or_too_closed(rendered):
    objects = rendered["tcp+components"]

    def whole_monitoring_namespace(policy):  # Prometheus admitted by namespace
        for rule in policy["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                if peer.get("podSelector") == {"matchLabels": PROMETHEUS}:
                    del peer["podSelector"]

    extra, missing = flow_differences(_without(objects, whole_monitoring_namespace))
    assert {source for source, *_ in extra} == {"grafana"} and not missing

    def no_default_deny(policy):
        if policy["metadata"]["name"] == "epd-default-deny":
            policy["spec"]["podSelector"] = {"matchLabels": {"nothing": "selected"}}

    extra, _ = flow_differences(_without(objects, no_default_deny))
    assert {("stranger", "public IPv4", "TCP", 443), ("client", "stranger", "TCP", 22)} <= extra

    def no_dns(policy):
        if policy["metadata"]["name"] == "epd-dns":
            policy["spec"]["egress"] = []

    extra, missing = flow_differences(_without(objects, no_dns))
    assert not extra and {target for _, target, *_ in missing} == {"kube-dns"}

    def fetches_everywhere(policy):
        if policy["metadata"]["name"] == "epd-gateway-fetches":
            for rule in policy["spec"]["egress"]:
                for peer in rule["to"]:
                    peer["ipBlock"].pop("except")

    extra, missing = flow_differences(_without(objects, fetches_everywhere))
    reached = {target for source, target, *_ in extra if source == "epd-gateway"}
    assert {"169.254.169.254", "10.0.0.1", "::ffff:10.0.0.1", "fd00:ec2::254"} <= reached


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_default_deny_selects_every_pod_in_and_out(rendered, variant):
    policies = of_kind(rendered[variant], "NetworkPolicy")
    denies = [
        p
        for p in policies
        if p["spec"]["podSelector"] == {}
        and not p["spec"].get("ingress")
        and not p["spec"].get("egress")
    ]
    assert len(denies) == 1 and set(denies[0]["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    for name, template in pod_specs(rendered[variant]):
        labels = template["metadata"]["labels"]
        assert all(selects(d["spec"]["podSelector"], labels) for d in denies), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_peers_in_other_namespaces_are_admitted_by_pod_not_by_namespace(rendered, variant):
    for policy in of_kind(rendered[variant], "NetworkPolicy"):
        for rule in policy["spec"].get("ingress", []) + policy["spec"].get("egress", []):
            for peer in rule.get("from", []) + rule.get("to", []):
                if "namespaceSelector" in peer:
                    assert peer.get("podSelector", {}).get("matchLabels"), (
                        f"{policy['metadata']['name']} admits a whole namespace: {peer}"
                    )
                    if peer["namespaceSelector"] == {"matchLabels": MONITORING}:
                        assert peer["podSelector"] == {"matchLabels": PROMETHEUS}


@pytest.mark.parametrize("variant", VARIANTS)
def test_mooncake_ports_are_pinned_to_the_range_the_policies_open(rendered, variant):
    objects = rendered[variant]
    ranges = {
        (entry["port"], entry["endPort"])
        for policy in of_kind(objects, "NetworkPolicy")
        for rule in policy["spec"].get("ingress", []) + policy["spec"].get("egress", [])
        for entry in rule.get("ports", [])
        if "endPort" in entry
    }
    engines = set()
    for _, template in pod_specs(objects):
        users = [c for c in containers(template) if runs_mooncake(c)]
        for container in users:
            low, high = mooncake_range(container)
            engines.add((low, high))
            assert high - low + 1 >= 2 * len(users), "each engine binds two ports: RPC and TCP data"
    assert ranges == engines, (
        "policies must open exactly the pinned Mooncake range (none where nothing runs it)"
    )


# ---- storage, secrets, shutdown ------------------------------------------------------------------


def mounts(template, container):
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    return [(m, volumes[m["name"]]) for m in container.get("volumeMounts", [])]


def secret_key(template, container, path: str) -> str:
    """The key of the epd-tokens Secret that ``path`` is in ``container``; the mount checked."""
    (found,) = [
        (m, v) for m, v in mounts(template, container) if path.startswith(m["mountPath"] + "/")
    ]
    mount, volume = found
    assert mount["readOnly"] is True and volume["secret"]["secretName"] == "epd-tokens"
    assert volume["secret"]["defaultMode"] & 0o077 <= 0o040, "readable by its group at most"
    key_paths = {item["path"]: item["key"] for item in volume["secret"]["items"]}
    return key_paths[path[len(mount["mountPath"]) + 1 :]]


def visible_keys(template, container) -> set[str]:
    """Every key of a Secret the container mounts."""
    return {
        item["key"]
        for _, volume in mounts(template, container)
        if "secret" in volume
        for item in volume["secret"]["items"]
    }


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_container_mounts_the_secret_keys_it_reads_and_no_other(rendered, variant):
    for name, template in pod_specs(rendered[variant]):
        for container in containers(template):
            program, _ = parsed(container)
            paths = token_files(container)
            assert all(paths), f"{program} runs without a token or key"
            read = {secret_key(template, container, path) for path in paths}
            assert len(read) == len(paths) and visible_keys(template, container) == read, (
                name,
                program,
            )
            for entry in container.get("env", []):  # tokens and keys never in env
                assert "secretKeyRef" not in entry.get("valueFrom", {}), entry


@pytest.mark.parametrize("variant", VARIANTS)
def test_vllm_runs_with_an_api_key_from_a_file_and_the_gateway_sends_it(rendered, variant):
    keys = {}
    for _, template in pod_specs(rendered[variant]):
        for container in containers(template):
            program, script, args = launched(container)
            if program == VLLM:  # the key is in no arg or env of the pod spec
                assert script and parsed(container)[1].api_key is None
                assert "--api-key" not in " ".join(args)
                assert "VLLM_API_KEY" not in container_env(container)
                keys["vllm"] = secret_key(template, container, file_read_by(script))
            if program == "epd-gateway":
                gateway = parsed(container)[1]
                keys["sent"] = secret_key(template, container, gateway.vllm_api_key_file)
                keys["clients"] = secret_key(template, container, gateway.api_key_file)
    assert keys == {"vllm": "vllm-api-key", "sent": "vllm-api-key", "clients": "gateway-api-key"}


def _fake_vllm(directory: Path) -> Path:
    """An executable ``vllm`` in ``directory`` that writes its key and argv to $OUT (JSON)."""
    directory.mkdir()
    program = directory / VLLM
    program.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        "with open(os.environ['OUT'], 'w') as out:\n"
        "    json.dump({'key': os.environ.get('VLLM_API_KEY'), 'argv': sys.argv[1:]}, out)\n"
    )
    program.chmod(0o755)
    return directory


def test_the_vllm_wrapper_exports_the_key_and_passes_the_args_as_they_are(rendered, tmp_path):
    """The containers' own shell command, run with a stand-in for vllm and the Secret's file in
    a directory of the test's: the key arrives in VLLM_API_KEY, the args arrive unchanged; a
    missing or empty key file stops it before vllm runs."""
    runs = {}
    for variant in OVERLAYS:
        for template in (t for _, t in pod_specs(rendered[variant])):
            for container in containers(template):
                program, script, args = launched(container)
                if program == VLLM:
                    (mount,) = [
                        m["mountPath"]
                        for m, _ in mounts(template, container)
                        if file_read_by(script).startswith(m["mountPath"] + "/")
                    ]
                    runs[script, tuple(args)] = mount
    assert len({script for script, _ in runs}) == 1, "one wrapper, written alike everywhere"
    bin_dir = _fake_vllm(tmp_path / "bin")
    for index, ((script, args), mount) in enumerate(runs.items()):
        tokens = tmp_path / f"tokens{index}"
        tokens.mkdir()
        local = script.replace(mount + "/", f"{tokens}/")
        key_file = Path(file_read_by(local))
        out = tmp_path / f"out{index}.json"
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(out)}

        def run():
            return subprocess.run(
                [*SHELL, local, VLLM, *args], env=env, capture_output=True, text=True, timeout=30
            )

        key_file.write_text("k3y-from-the-secret\n")
        result = run()
        assert result.returncode == 0, result.stderr
        assert json.loads(out.read_text()) == {"key": "k3y-from-the-secret", "argv": list(args)}
        out.unlink()
        for content in ("", "\n"):
            key_file.write_text(content)
            result = run()
            assert result.returncode != 0 and "is empty" in result.stderr and not out.exists()
        key_file.unlink()
        result = run()
        assert result.returncode != 0 and str(key_file) in result.stderr and not out.exists()


def test_the_docs_create_the_secret_with_every_key_the_manifests_mount(rendered):
    mounted = {
        item["key"]
        for variant in VARIANTS
        for _, template in pod_specs(rendered[variant])
        for volume in template["spec"]["volumes"]
        if volume.get("secret", {}).get("secretName") == "epd-tokens"
        for item in volume["secret"]["items"]
    }
    docs = (ROOT / "docs" / "deploy.md").read_text()
    (command,) = re.findall(
        r"kubectl -n epd create secret generic epd-tokens(?:[^\n]*\\\n)+[^\n]*", docs
    )
    assert set(re.findall(r"--from-literal=([\w-]+)=", command)) == mounted
    assert mounted == {"handshake-token", "intake-token", "vllm-api-key", "gateway-api-key"}


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
            if program == VLLM:  # the receive pool is a /dev/shm segment vLLM's EngineCore creates
                assert args.connector.pool_bytes <= shm - 256 * (1 << 20), name
                assert limit >= args.connector.pool_bytes + 16 * gib, (
                    "the pool besides vLLM's own memory"
                )
            if program == "epd-encode-worker":
                assert limit >= args.ring_bytes + args.cache_bytes + 8 * gib
            if program in ("epd-encode-worker", VLLM, "epd-gateway"):  # the checkpoint, read-only
                model = args.model_tag if program == VLLM else args.model
                assert any(
                    m["mountPath"] == "/models" and m["readOnly"]
                    for m, _ in mounts(template, container)
                )
                assert any(
                    model.startswith(m["mountPath"] + "/") for m, _ in mounts(template, container)
                )


@pytest.mark.parametrize("variant", VARIANTS)
def test_encode_workers_keep_their_compile_cache_on_a_volume_of_its_own(rendered, variant):
    """A restarted worker finds its compiled tower where it left it: --compile-cache-dir is a
    writable, bounded volume, not the root filesystem (read-only) nor the /tmp scratch."""
    workers = 0
    for _, template in pod_specs(rendered[variant]):
        for container in containers(template):
            program, args = parsed(container)
            if program != "epd-encode-worker":
                continue
            workers += 1
            (mount, volume), *others = [
                (m, v)
                for m, v in mounts(template, container)
                if m["mountPath"] == args.compile_cache_dir
            ]
            assert not others and not mount.get("readOnly")
            assert volume.get("persistentVolumeClaim") or volume["emptyDir"]["sizeLimit"]
    assert workers


def test_same_node_containers_share_one_memory_backed_dev_shm_as_one_user(rendered):
    for variant in ("same-node", "same-node+components"):
        (template,) = [t for n, t in pod_specs(rendered[variant]) if n == "epd-encode-worker"]
        programs = {parsed(c)[0]: c for c in containers(template)}
        assert set(programs) == {"epd-encode-worker", VLLM, "epd-gateway"}
        shm_users = [programs["epd-encode-worker"], programs[VLLM]]
        shm_volumes = {
            v["name"]
            for c in shm_users
            for m, v in mounts(template, c)
            if m["mountPath"] == "/dev/shm"
        }
        assert len(shm_volumes) == 1 and all(
            any(m["mountPath"] == "/dev/shm" for m, _ in mounts(template, c)) for c in shm_users
        )
        assert all(transports(*parsed(c)) == ["shm"] for c in shm_users)
        assert all("runAsUser" not in c.get("securityContext", {}) for c in programs.values()), (
            "SHM segments are 0600 and owner-checked: the containers run as the pod's user"
        )
        assert not [
            d for n, d in pod_specs(rendered[variant]) if n in ("epd-prefill", "epd-gateway")
        ]


@pytest.mark.parametrize("variant", VARIANTS)
def test_graceful_termination_outlasts_in_flight_writes(rendered, variant):
    from encode_worker.worker import EncodeWorker
    from epdserve.data_plane.mooncake import MooncakeConfig
    from prefill_side.settings import ReceiverConfig

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
            assert ReceiverConfig(width=1).quarantine_s > writer.engine_timeout_s(
                args.ring_slot_bytes
            )


def drain_s(program, args) -> float | None:
    """How long ``program`` lets answers in flight finish after SIGTERM (None: it serves none)."""
    if program == "epd-gateway":
        return args.drain_s
    if program == VLLM:  # vLLM's --shutdown-timeout (0: abort them)
        return args.shutdown_timeout
    return None


@pytest.mark.parametrize("variant", VARIANTS)
def test_answers_in_flight_at_sigterm_finish_within_the_grace_period(rendered, variant):
    served = set()
    for name, template in pod_specs(rendered[variant]):
        grace = template["spec"]["terminationGracePeriodSeconds"]
        for container in containers(template):
            program, args = parsed(container)
            drain = drain_s(program, args)
            if drain is None:
                continue
            served.add(program)
            pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
            assert drain > 0 and pre_stop + drain + 10 <= grace, (name, program, drain, grace)
    assert served == {"epd-gateway", VLLM}


def qos_class(template) -> str:
    """The pod's QoS class, as the kubelet computes it."""
    resources = [c.get("resources", {}) for c in containers(template)]
    if all(
        kind in r.get("limits", {})
        and amount(r.get("requests", {}).get(kind, r["limits"][kind])) == amount(r["limits"][kind])
        for r in resources
        for kind in ("cpu", "memory")
    ):
        return "Guaranteed"
    if any(r.get("requests") or r.get("limits") for r in resources):
        return "Burstable"
    return "BestEffort"


@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_pods_are_guaranteed(rendered, variant):
    gpu_pods = 0
    for name, template in pod_specs(rendered[variant]):
        if not any("nvidia.com/gpu" in c["resources"]["limits"] for c in containers(template)):
            continue
        gpu_pods += 1
        assert qos_class(template) == "Guaranteed", name
        for container in containers(template):
            resources = container["resources"]
            assert {k: amount(v) for k, v in resources["requests"].items()} == {
                k: amount(v) for k, v in resources["limits"].items()
            }, (name, container["name"])
    assert gpu_pods == (1 if variant.startswith("same-node") else 2)


def test_qos_class_tells_burstable_from_guaranteed(rendered):
    (gateway,) = [t for n, t in pod_specs(rendered["tcp"]) if n == "epd-gateway"]
    assert qos_class(gateway) == "Burstable"
    (encode,) = [t for n, t in pod_specs(rendered["tcp"]) if n == "epd-encode-worker"]
    encode = json.loads(json.dumps(encode))
    assert qos_class(encode) == "Guaranteed"
    encode["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "7500m"
    assert qos_class(encode) == "Burstable"


def deployment(objects, name: str) -> dict:
    (found,) = [d for d in of_kind(objects, "Deployment") if d["metadata"]["name"] == name]
    return found


def budgets_of(objects, template) -> list[dict]:
    return [
        pdb
        for pdb in of_kind(objects, "PodDisruptionBudget")
        if selects(pdb["spec"]["selector"], template["metadata"]["labels"])
    ]


@pytest.mark.parametrize("variant", VARIANTS)
def test_rollouts_and_drains_keep_a_vllm_engine_and_a_gateway_serving(rendered, variant):
    objects = rendered[variant]
    for workload in of_kind(objects, "Deployment"):
        template, spec = workload["spec"]["template"], workload["spec"]
        programs = {parsed(c)[0] for c in containers(template)}
        replicas = spec.get("replicas")  # none: the HPA's
        for pdb in budgets_of(objects, template):  # a budget never blocks every eviction
            if "minAvailable" in pdb["spec"]:
                assert replicas is None or pdb["spec"]["minAvailable"] < replicas
            else:
                assert pdb["spec"]["maxUnavailable"] >= 1
        if programs == {VLLM} or programs == {"epd-gateway"}:
            # a new pod first, then an old one goes: the last ready one never goes first
            assert spec["strategy"] == {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            }, workload["metadata"]["name"]
        if programs == {"epd-gateway"}:
            assert replicas >= 2 and len(budgets_of(objects, template)) == 1
    if variant.split("+")[0] in ("tcp", "rdma"):  # two engines, one kept through disruptions
        engine = deployment(objects, "epd-prefill")
        assert engine["spec"]["replicas"] >= 2
        (pdb,) = budgets_of(objects, engine["spec"]["template"])
        assert pdb["spec"] == {"minAvailable": 1, "selector": engine["spec"]["selector"]}
    if variant.split("+")[0] in ("base", "tensor-parallel"):  # one engine, and so no budget
        engine = deployment(objects, "epd-prefill")
        assert engine["spec"]["replicas"] == 1
        assert not budgets_of(objects, engine["spec"]["template"])


# ---- components ----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.endswith("+components")])
def test_service_monitors_scrape_real_ports(rendered, variant):
    objects = rendered[variant]
    monitors = of_kind(objects, "ServiceMonitor")
    assert {m["apiVersion"] for m in monitors} == {"monitoring.coreos.com/v1"} and len(
        monitors
    ) == 4
    services = of_kind(objects, "Service")
    for monitor in monitors:
        matched = [
            s for s in services if selects(monitor["spec"]["selector"], s["metadata"]["labels"])
        ]
        assert matched, monitor["metadata"]["name"]
        for endpoint in monitor["spec"]["endpoints"]:
            assert set(endpoint) <= {"port", "path", "interval"} and endpoint["path"] == "/metrics"
            for service in matched:
                assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    scraped = {  # (pod template, container port name) each ServiceMonitor endpoint reaches
        (id(template), port["targetPort"])
        for monitor in monitors
        for service in services
        if selects(monitor["spec"]["selector"], service["metadata"]["labels"])
        for port in service["spec"]["ports"]
        if port["name"] in {endpoint["port"] for endpoint in monitor["spec"]["endpoints"]}
        for _, template in pod_specs(objects)
        if selects({"matchLabels": service["spec"]["selector"]}, template["metadata"]["labels"])
    }
    for name, template in pod_specs(objects):
        for container in containers(template):
            program, _ = parsed(container)
            for port in http_port_names(program):
                assert (id(template), port) in scraped, f"{name}: {program}'s {port} not scraped"


def test_hpa_scales_the_encoders_on_a_metric_they_export(rendered):
    from encode_worker import metrics as worker  # where its families are declared

    objects = rendered["tcp+components"]
    (hpa,) = of_kind(objects, "HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]["name"]
    (encode,) = [d for d in of_kind(objects, "Deployment") if d["metadata"]["name"] == target]
    assert "replicas" not in encode["spec"], "the HPA owns the replica count"
    (metric,) = hpa["spec"]["metrics"]
    assert f'"{metric["pods"]["metric"]["name"]}"' in Path(worker.__file__).read_text()
    (container,) = [
        c for c in containers(encode["spec"]["template"]) if parsed(c)[0] == "epd-encode-worker"
    ]
    assert int(metric["pods"]["target"]["averageValue"]) < parsed(container)[1].queue_items, (
        "scale before intake refuses"
    )
    (pdb,) = budgets_of(objects, encode["spec"]["template"])
    assert hpa["spec"]["minReplicas"] > pdb["spec"]["maxUnavailable"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_workload_selectors_match_their_own_pods(rendered, variant):
    for deployment in of_kind(rendered[variant], "Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selects(deployment["spec"]["selector"], labels)
        for constraint in deployment["spec"]["template"]["spec"].get(
            "topologySpreadConstraints", []
        ):
            assert selects(constraint["labelSelector"], labels)
    (encode,) = [
        d
        for d in of_kind(rendered[variant], "Deployment")
        if d["metadata"]["name"] == "epd-encode-worker"
    ]
    assert len(encode["spec"]["template"]["spec"]["topologySpreadConstraints"]) == 2


# ---- the image -----------------------------------------------------------------------------------


def _commands_by_image(rendered) -> dict[str, set[str]]:
    """The commands the manifests run in each image (as the manifests name them)."""
    commands = {IMAGE: set(), VLLM_IMAGE: set()}
    for variant in OVERLAYS:
        for _, template in pod_specs(rendered[variant]):
            for container in containers(template):
                commands[container["image"].rsplit(":", 1)[0]].add(launched(container)[0])
    return commands


def _dockerfile_user(text: str, rendered) -> None:
    """The image's USER is the uid every non-root pod runs as."""
    (user,) = re.findall(r"^USER (\d+)", text, re.M)
    for variant in VARIANTS:
        for _, template in pod_specs(rendered[variant]):
            if template["spec"]["securityContext"].get("runAsNonRoot"):
                assert template["spec"]["securityContext"]["runAsUser"] == int(user)


def test_dockerfile_builds_what_the_manifests_run(rendered):
    text = (ROOT / "Dockerfile").read_text()
    (base,) = re.findall(r"^FROM (\S+)", text, re.M)
    assert re.search(r":[\w.-]+$", base) and not base.endswith(":latest")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert re.search(r'pip install [^\n]*"/src\[encoder,\$\{MOONCAKE\}\]"', text)
    (mooncake,) = re.findall(r"^ARG MOONCAKE=(\S+)", text, re.M)
    assert mooncake == "mooncake-cuda12" and mooncake in extras  # the CUDA 12 base image's
    for package in ("libibverbs1", "ibverbs-providers", "librdmacm1"):
        assert re.search(rf"\b{package}\b", text)
    _dockerfile_user(text, rendered)
    assert _commands_by_image(rendered)[IMAGE] <= set(SCRIPTS)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_vllm_dockerfile_adds_the_project_to_vllms_own_image(rendered):
    text = (ROOT / "Dockerfile.vllm").read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    (pin,) = extras["vllm"]
    (base,) = re.findall(r"^FROM (\S+)", text, re.M)
    assert pin == "vllm==0.32.0" and base == f"vllm/vllm-openai:v{pin.split('==')[1]}", (
        "the image's vLLM is the one the connector is written (and tested) against"
    )
    # the project and Mooncake's GPU wheel, every package of vLLM's image held at its version
    (install,) = re.findall(r"pip install [^\n]*", text)
    assert '"/src[${MOONCAKE}]"' in install and "-c " in install  # the receiver, no encoder
    (mooncake,) = re.findall(r"^ARG MOONCAKE=(\S+)", text, re.M)
    assert mooncake in extras and mooncake.startswith("mooncake-cuda")
    assert re.search(r"pip list --format=freeze > (\S+)", text).group(1) in install
    assert "torch" not in install and "--upgrade" not in install and " -U " not in install
    assert "import prefill_side.vllm_connector, mooncake.engine" in text
    for package in ("libibverbs1", "ibverbs-providers", "librdmacm1"):
        assert re.search(rf"\b{package}\b", text)
    _dockerfile_user(text, rendered)
    assert re.search(r'^ENTRYPOINT \["vllm"\]', text, re.M)
    assert _commands_by_image(rendered)[VLLM_IMAGE] == {VLLM}
    assert (
        "docker build -f Dockerfile.vllm" in text
        and "docker build -f Dockerfile.vllm" in (ROOT / "docs" / "deploy.md").read_text()
    )


# ---- the flag the manifests needed ---------------------------------------------------------------


@pytest.mark.processes
def test_prefill_offers_mooncake_at_its_mooncake_host(tmp_path):
    """epd-prefill advertises --mooncake-host in its offers (the manifests pass the pod IP)."""
    from epdserve.testing.receive_items import loopback_handshake
    from handshake.app import create_app
    from handshake.rooms import RoomTable
    from handshake.server import ThreadedServer

    table = RoomTable()
    rooms = ThreadedServer(create_app(table)).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        MC_LOG_LEVEL="ERROR",
        EPD_PREFILL_MOONCAKE_HOST="127.0.0.2",
    )
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "epdserve.prefill_server.cli",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--width",
            "8",
            "--transports",
            "mooncake",
            "--pool-bytes",
            str(1 << 20),
            "--slot-bytes",
            str(1 << 16),
        ],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    try:
        (room,) = table.mint(1, 30)
        body = json.dumps(
            {
                "request_id": "r",
                "timeout_s": 3,
                "items": [
                    {
                        "offsets": [[0, 3]],
                        "encode_handshake": loopback_handshake(room, rooms.port),
                    }
                ],
            }
        ).encode()
        sender = concurrent.futures.ThreadPoolExecutor(1)
        sent = sender.submit(_post_when_up, f"http://127.0.0.1:{port}", body)
        sender.shutdown(wait=False)
        end = time.monotonic() + 60
        while table.view(room).registration is None:
            assert time.monotonic() < end and process.poll() is None, (
                "epd-prefill never registered the room"
            )
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
    request = urllib.request.Request(
        f"{url}/v1/prefill", data=body, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status, json.loads(response.read())
