"""compose.yaml, the Dockerfile and deploy/ checked against the code they deploy (no Docker).

- compose.yaml is valid against the Compose Specification's JSON schema (vendored from
  compose-spec/compose-spec in deploy/schema/), after interpolation with the variables a
  user's .env holds (``DEPLOY_ENV``);
- every ``depends_on``, volume and mounted file exists; every service has a health check;
  executors each reserve their own GPU;
- every meshserve service's command parses with that service's real argparse parser under the
  environment compose gives it, every MESHSERVE_* variable it sets is one the service reads,
  and every OTEL_* variable is one OpenTelemetry defines;
- health checks, Prometheus scrape jobs and the services agree on ports; Prometheus scrapes
  the unpublished metrics ports;
- secure defaults: the gateway refuses to start without API keys unless
  MESHSERVE_ALLOW_UNAUTHENTICATED=1, and every published port binds to 127.0.0.1 unless a
  host variable says otherwise;
- the Grafana dashboard queries only metrics the services export, through provisioned
  datasources.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import stat
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import jsonschema
import opentelemetry.environment_variables
import opentelemetry.sdk.environment_variables
import pytest
import yaml

from common.metrics import all_metric_names
from common.nats_permissions import ROLES, password_variable
from tests.environ import RecordingEnviron

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
INTERPOLATION = re.compile(
    r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
)
OTEL_VARIABLES = {
    name
    for module in (opentelemetry.environment_variables, opentelemetry.sdk.environment_variables)
    for name in dir(module)
    if name.startswith("OTEL_")
}
# What a user's .env holds (deploy/gen_secrets.py writes it): every required variable.
DEPLOY_ENV = {
    "MESHSERVE_API_KEYS": "test-api-key",
    "GRAFANA_ADMIN_PASSWORD": "test-grafana",
    **{password_variable(role): f"test-{role}" for role in ROLES},
}
# The mesh services' modules -> their role, i.e. NATS user (common/nats_permissions.py).
ROLE_OF_MODULE = {f"services.{role.replace('-', '_')}": role for role in ROLES}
SAMPLERS = {
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
}


class MissingVariable(ValueError):
    """``${VAR:?message}`` with VAR unset or empty: compose refuses the file."""


def interpolate(value: Any, environ: dict[str, str] | None = None) -> Any:
    """Compose's variable substitution under ``environ`` (default: the variables a user's .env
    must hold, ``DEPLOY_ENV``): ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``,
    ``${VAR:?error}`` and ``${VAR?error}``."""
    environ = DEPLOY_ENV if environ is None else environ
    if isinstance(value, str):

        def substitute(m: re.Match[str]) -> str:
            name, op, arg = m.group("name"), m.group("op") or "", m.group("arg") or ""
            if name is None:  # "$$": a literal "$"
                return "$"
            given = environ.get(name)
            present = bool(given) if op.startswith(":") else given is not None
            if op.endswith("?") and not present:
                raise MissingVariable(f"{name}: {arg}")
            return given if present and given is not None else ("" if op.endswith("?") else arg)

        return INTERPOLATION.sub(substitute, value)
    if isinstance(value, list):
        return [interpolate(v, environ) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, environ) for k, v in value.items()}
    return value


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = interpolate(load_yaml(ROOT / "compose.yaml"))
    return loaded


def test_interpolation_follows_compose():
    env = {"SET": "v", "EMPTY": ""}
    cases = {
        "${SET}": "v",
        "${UNSET}": "",
        "${SET:-d}": "v",
        "${EMPTY:-d}": "d",
        "${EMPTY-d}": "",
        "${UNSET-d}": "d",
        "${SET:?m}": "v",
        "${EMPTY?m}": "",
        "$${SET}": "${SET}",
    }
    for text, expected in cases.items():
        assert interpolate(text, env) == expected, text
    for text in ("${UNSET:?m}", "${EMPTY:?m}", "${UNSET?m}"):
        with pytest.raises(MissingVariable):
            interpolate(text, env)


def mesh_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The services that run a meshserve module (``python -m services.<x>``)."""
    return {
        name: svc
        for name, svc in compose["services"].items()
        if svc.get("command", [])[:2] == ["python", "-m"]
    }


def health_port(svc: dict[str, Any]) -> int:
    probe = " ".join(svc["healthcheck"]["test"])
    match = re.search(r"http://127\.0\.0\.1:(\d+)/health", probe)
    assert match, f"health check does not probe /health: {probe}"
    return int(match.group(1))


def gpu_devices(svc: dict[str, Any]) -> list[str]:
    devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    ids = []
    for device in devices:
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        ids += device["device_ids"]
    return ids


def test_compose_matches_the_compose_schema(compose):
    schema = json.loads((DEPLOY / "schema" / "compose-spec.json").read_text())
    errors = sorted(
        jsonschema.Draft7Validator(schema).iter_errors(compose), key=lambda e: list(e.path)
    )
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_compose_structure_and_references(compose):
    services = compose["services"]
    expected = {"nats", "jaeger", "prometheus", "grafana", "gateway", "tokenizer"}
    expected |= {"prefix-index", "scheduler", "executor-0", "speculator", "detokenizer"}
    assert expected <= set(services)
    assert "-js" in services["nats"]["command"] and "-m" in services["nats"]["command"]
    volumes = set(compose.get("volumes", {}))
    for name, svc in services.items():
        for dependency in svc.get("depends_on", {}):
            assert dependency in services, f"{name} depends on unknown {dependency}"
        if name != "jaeger":  # its image has no shell tool to probe with
            assert "healthcheck" in svc, f"{name} has no health check"
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./deploy"):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
            elif not source.startswith((".", "/")):
                assert source in volumes, f"{name} uses undeclared volume {source}"
    mesh = mesh_services(compose)
    assert set(mesh) >= expected - {"nats", "jaeger", "prometheus", "grafana"}
    for name, svc in mesh.items():
        for dependency, condition in svc.get("depends_on", {}).items():
            assert condition["condition"] == "service_healthy", (name, dependency)


def test_executors_each_reserve_their_own_gpu(compose):
    mesh = mesh_services(compose)
    executors = {n: s for n, s in mesh.items() if s["command"][2] == "services.executor"}
    assert len(executors) >= 2
    devices = [gpu_devices(svc) for svc in executors.values()]
    assert all(len(d) == 1 for d in devices), devices
    # The disaggregated pair (profile disagg) replaces the mixed executors on the same GPUs.
    for pool in ([s for s in executors.values() if "disagg" not in s.get("profiles", [])],
                 [s for s in executors.values() if "disagg" in s.get("profiles", [])]):  # fmt: skip
        used = [gpu_devices(svc)[0] for svc in pool]
        assert len(set(used)) == len(used), "two executors share a GPU"
    ids = [svc["environment"]["MESHSERVE_INSTANCE_ID"] for svc in executors.values()]
    assert sorted(ids) == sorted(executors), "an executor's id differs from its service name"
    assert all(svc["environment"]["MESHSERVE_DEVICE"] == "cuda" for svc in executors.values())
    # A GPU executor's engine thread only launches kernels: it runs at the process's priority.
    from services.executor.config import parse_args as executor_args

    for name, svc in executors.items():
        env = {k: str(v) for k, v in svc["environment"].items()}
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(os, "environ", env)
            assert executor_args(svc["command"][3:]).engine_nice == 0, name
    assert gpu_devices(mesh["speculator"]), "the speculator's draft model needs a GPU"


def compose_mesh_services() -> list[str]:
    return sorted(mesh_services(interpolate(load_yaml(ROOT / "compose.yaml"))))


@pytest.mark.parametrize("name", compose_mesh_services())
def test_command_and_environment_match_the_service_cli(compose, name, monkeypatch):
    svc = mesh_services(compose)[name]
    module = svc["command"][2]
    try:
        entry = importlib.import_module(f"{module}.__main__")
    except ModuleNotFoundError as exc:
        if exc.name is not None and module.startswith(exc.name):
            pytest.skip(f"{module} is not written yet")
        raise
    environment = {k: str(v) for k, v in svc.get("environment", {}).items()}
    recording = RecordingEnviron(environment)
    monkeypatch.setattr(os, "environ", recording)
    try:
        # The gateway's process starts from serving_config: parse_args plus its refusals.
        parse = entry.serving_config if module == "services.gateway" else entry.parse_args
        config = parse(svc["command"][3:])
    except (SystemExit, ValueError) as exc:  # argparse exits; config checks raise
        pytest.fail(f"{name}: {svc['command']} with its environment is rejected ({exc})")
    monkeypatch.undo()

    unread = {k for k in environment if k.startswith("MESHSERVE_")} - recording.read
    assert not unread, f"{name} sets variables the service never reads: {sorted(unread)}"
    unknown = {k for k in environment if not k.startswith("MESHSERVE_")} - OTEL_VARIABLES
    assert not unknown, f"{name} sets variables nothing reads: {sorted(unknown)}"
    assert environment.get("OTEL_TRACES_SAMPLER", "always_on") in SAMPLERS

    assert config.mesh.nats_url == "nats://nats:4222"
    endpoint = urlparse(environment["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert endpoint.hostname in compose["services"] and endpoint.port == 4318
    if module == "services.gateway":
        assert health_port(svc) == config.port
        assert any(str(p).endswith(f":{config.port}") for p in svc["ports"])
    else:
        assert config.mesh.metrics_port is not None, f"{name} serves no /metrics"
        assert health_port(svc) == config.mesh.metrics_port


def test_the_cluster_settings_of_dot_env_reach_every_mesh_service(monkeypatch):
    """docs/deploy.md's cluster profile: the NATS URLs and R3 set in .env reach the services
    (compose passes .env only to ``${...}`` in compose.yaml, not into the containers)."""
    urls = "nats://nats-1:4222,nats://nats-2:4222,nats://nats-3:4222"
    environ = {**DEPLOY_ENV, "MESHSERVE_NATS_URL": urls, "MESHSERVE_KV_REPLICAS": "3"}
    for name, svc in mesh_services(interpolate(load_yaml(ROOT / "compose.yaml"), environ)).items():
        entry = importlib.import_module(f"{svc['command'][2]}.__main__")
        parse = entry.serving_config if name == "gateway" else entry.parse_args
        monkeypatch.setattr(os, "environ", {k: str(v) for k, v in svc["environment"].items()})
        config = parse(svc["command"][3:])
        monkeypatch.undo()
        assert (config.mesh.nats_url, config.mesh.kv_replicas) == (urls, 3), name


def gateway_config(environ: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The compose gateway's config under ``environ`` as the user's .env (SystemExit when the
    gateway refuses to start)."""
    svc = interpolate(load_yaml(ROOT / "compose.yaml"), environ)["services"]["gateway"]
    entry = importlib.import_module("services.gateway.__main__")
    monkeypatch.setattr(os, "environ", {k: str(v) for k, v in svc["environment"].items()})
    try:
        return entry.serving_config(svc["command"][3:])
    finally:
        monkeypatch.undo()


def test_the_gateway_refuses_to_start_without_api_keys(monkeypatch, capsys):
    without_keys = {k: v for k, v in DEPLOY_ENV.items() if k != "MESHSERVE_API_KEYS"}
    with pytest.raises(SystemExit):
        gateway_config(without_keys, monkeypatch)
    assert "refusing to serve without API keys" in capsys.readouterr().err
    opted_out = gateway_config(without_keys | {"MESHSERVE_ALLOW_UNAUTHENTICATED": "1"}, monkeypatch)
    assert opted_out.api_keys == () and opted_out.allow_unauthenticated
    keyed = gateway_config(DEPLOY_ENV | {"MESHSERVE_API_KEYS": "k1,k2"}, monkeypatch)
    assert keyed.api_keys == ("k1", "k2") and not keyed.allow_unauthenticated


def test_published_ports_bind_loopback_unless_told_otherwise(compose):
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"
    assert compose["services"]["gateway"]["ports"] == ["127.0.0.1:8000:8000"]
    public = interpolate(
        load_yaml(ROOT / "compose.yaml"), DEPLOY_ENV | {"MESHSERVE_HTTP_BIND": "0.0.0.0"}
    )
    assert public["services"]["gateway"]["ports"] == ["0.0.0.0:8000:8000"]


def raw_compose() -> dict[str, Any]:
    """compose.yaml before interpolation: the ``${...}`` references as written."""
    loaded: dict[str, Any] = load_yaml(ROOT / "compose.yaml")
    return loaded


def test_no_secret_has_a_default_in_the_repository():
    text = (ROOT / "compose.yaml").read_text()
    assert "change-me" not in text
    secret = re.compile(r"PASSWORD|SECRET|API_KEY|CREDS|NKEY|(^|_)TOKEN$")
    for m in INTERPOLATION.finditer(text):
        name = m.group("name")
        if name is None or not secret.search(name):
            continue
        if name == "MESHSERVE_API_KEYS":  # empty: the gateway itself refuses to start
            assert (m.group("op"), m.group("arg")) == (":-", ""), m.group(0)
        else:
            assert m.group("op") == ":?", f"{m.group(0)}: a secret needs ${{VAR:?...}}"
    for name, svc in raw_compose()["services"].items():
        for key, value in svc.get("environment", {}).items():
            if secret.search(key):
                assert re.fullmatch(r"\$\{[A-Z_]+:[?-][^}]*\}", str(value)), (name, key, value)


@pytest.mark.parametrize("variable", sorted(set(DEPLOY_ENV) - {"MESHSERVE_API_KEYS"}))
def test_compose_refuses_to_start_without_each_secret(variable):
    with pytest.raises(MissingVariable, match=variable):
        interpolate(raw_compose(), {k: v for k, v in DEPLOY_ENV.items() if k != variable})


def test_each_mesh_service_logs_in_to_nats_as_its_own_user(compose):
    raw = raw_compose()["services"]
    users = {}
    for name, svc in mesh_services(compose).items():
        role = ROLE_OF_MODULE[svc["command"][2]]
        environment = svc["environment"]
        assert environment["MESHSERVE_NATS_USER"] == role, name
        assert environment["MESHSERVE_NATS_PASSWORD"] == DEPLOY_ENV[password_variable(role)]
        users[name] = role
    assert set(users.values()) == set(ROLES), "a role has no compose service"
    assert raw["gateway"]["environment"]["MESHSERVE_NATS_PASSWORD"].startswith(
        "${NATS_PASSWORD_GATEWAY:?"
    )

    nats = compose["services"]["nats"]
    command = nats["command"]
    config_path = command[command.index("-c") + 1]
    mounts = dict(v.split(":")[1::-1] for v in nats["volumes"] if v.startswith("./"))
    config_file = ROOT / mounts[config_path]
    assert config_file == DEPLOY / "nats" / "nats-server.conf"
    assert "--user" not in command and "--pass" not in command  # no shared user
    # nats-server resolves each user's password from its environment: exactly these.
    referenced = set(re.findall(r"password: \$(\w+)", config_file.read_text()))
    assert referenced == {password_variable(role) for role in ROLES}
    assert set(nats["environment"]) == referenced
    assert all(nats["environment"][v] == DEPLOY_ENV[v] for v in referenced)
    assert not any(str(p).endswith(":4222") for p in nats.get("ports", [])), "NATS is published"


def run_gen_secrets(env_file: Path) -> str:
    # -I: no PYTHONPATH, no user site: as on a Docker host without meshserve installed.
    script = str(ROOT / "deploy" / "gen_secrets.py")
    done = subprocess.run(
        [sys.executable, "-I", script, "--env-file", str(env_file)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return done.stdout


def read_env(env_file: Path) -> dict[str, str]:
    lines = [line for line in env_file.read_text().splitlines() if line and line[0] != "#"]
    return dict(line.split("=", 1) for line in lines)


def test_gen_secrets_writes_what_compose_requires(tmp_path, monkeypatch):
    env_file = tmp_path / ".env"
    assert "MESHSERVE_API_KEYS" in run_gen_secrets(env_file)
    written = read_env(env_file)
    required = set(re.findall(r"\$\{(\w+):\?", (ROOT / "compose.yaml").read_text()))
    assert set(written) == required | {"MESHSERVE_API_KEYS"}
    assert len(set(written.values())) == len(written), "two secrets share a value"
    assert all(len(v) >= 40 and re.fullmatch(r"[A-Za-z0-9_-]+", v) for v in written.values())
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    interpolate(raw_compose(), written)  # compose accepts it
    assert gateway_config(written, monkeypatch).api_keys == (written["MESHSERVE_API_KEYS"],)

    # A second run, or one over a .env with the user's own settings, keeps every value.
    before = env_file.read_text()
    assert "nothing changed" in run_gen_secrets(env_file)
    assert env_file.read_text() == before
    own = tmp_path / "own.env"
    own.write_text("MESHSERVE_MODEL=/models/x.gguf\nNATS_PASSWORD_GATEWAY=mine")  # no newline
    run_gen_secrets(own)
    mixed = read_env(own)
    assert mixed["MESHSERVE_MODEL"] == "/models/x.gguf" and mixed["NATS_PASSWORD_GATEWAY"] == "mine"
    assert set(mixed) == set(written) | {"MESHSERVE_MODEL"}


def test_tokenizer_executors_and_detokenizers_agree_on_the_layout(compose, monkeypatch):
    mesh = mesh_services(compose)
    by_module: dict[str, list[dict[str, str]]] = {}
    for svc in mesh.values():
        by_module.setdefault(svc["command"][2], []).append(svc.get("environment", {}))
    pages = {
        env["MESHSERVE_PAGE_SIZE"]
        for module in ("services.tokenizer", "services.executor")
        for env in by_module[module]
    }
    assert len(pages) == 1, f"page sizes disagree: {pages}"
    # The tokenizer picks each request's detokenizer shard (the executors send its tokens
    # there), so only the tokenizer is told how many shards there are.
    assert all("MESHSERVE_DETOK_SHARDS" not in env for env in by_module["services.executor"])
    (shards,) = {env["MESHSERVE_DETOK_SHARDS"] for env in by_module["services.tokenizer"]}
    served = sorted(int(env["MESHSERVE_DETOK_SHARD"]) for env in by_module["services.detokenizer"])
    assert served == list(range(int(shards))), "every detokenizer shard must be served once"


def test_prometheus_scrapes_every_service_where_it_serves(compose):
    config = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    targets: dict[str, int] = {}
    for job in config["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            for host in sd["names"]:
                targets[host] = sd["port"]
    for name, svc in mesh_services(compose).items():
        assert name in targets, f"Prometheus does not scrape {name}"
        # The metrics port, which needs no API key and is not published (the gateway's HTTP
        # port serves /metrics too, but only with a key).
        metrics_port = int(svc["environment"]["MESHSERVE_METRICS_PORT"])
        assert targets[name] == metrics_port, f"{name} is scraped on the wrong port"
        published = [str(port).rsplit(":", 1)[-1] for port in svc.get("ports", [])]
        assert str(metrics_port) not in published, f"{name} publishes its metrics port"
    unknown = set(targets) - set(compose["services"])
    assert not unknown, f"Prometheus scrapes services compose does not define: {unknown}"
    command = compose["services"]["prometheus"]["command"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in command
    assert "--enable-feature=exemplar-storage" in command


def test_grafana_is_provisioned_with_the_dashboard_and_datasources(compose):
    grafana = compose["services"]["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"] if v.startswith("./"))
    provisioning = ROOT / next(s for s, t in mounts.items() if t == "/etc/grafana/provisioning")
    datasources = load_yaml(provisioning / "datasources" / "datasources.yaml")["datasources"]
    uids = {ds["uid"]: ds for ds in datasources}
    assert uids["prometheus"]["type"] == "prometheus" and uids["jaeger"]["type"] == "jaeger"
    assert urlparse(uids["prometheus"]["url"]).hostname == "prometheus"
    assert urlparse(uids["jaeger"]["url"]).hostname == "jaeger"
    exemplars = uids["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert exemplars == [{"name": "trace_id", "datasourceUid": "jaeger"}]

    provider = load_yaml(provisioning / "dashboards" / "dashboards.yaml")["providers"][0]
    folder = provider["options"]["path"]
    source = [s for s, t in mounts.items() if t == folder]
    assert source, f"no mount provides the dashboards folder {folder}"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (ROOT / source[0] / Path(home).relative_to(folder)).is_file()


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboard_queries_only_exported_metrics():
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "meshserve.json").read_text())
    exported = all_metric_names()
    used = set()
    for expr in dashboard_exprs(dashboard):
        for name in re.findall(r"meshserve:[A-Za-z0-9_:]+", expr):
            base = re.sub(r"_(bucket|count|sum)$", "", name)
            used.add(base)
            assert base in exported, f"the dashboard queries {name}, which nothing exports"
    for family in (
        "meshserve:time_to_first_token_seconds",
        "meshserve:inter_token_latency_seconds",
        "meshserve:time_per_output_token_seconds",
        "meshserve:e2e_request_latency_seconds",
        "meshserve:num_requests_waiting",
        "meshserve:kv_cache_usage_perc",
        "meshserve:prefix_cache_hits_total",
        "meshserve:spec_decode_num_accepted_tokens_total",
    ):
        assert family in used, f"the dashboard has no panel on {family}"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for expr in dashboard_exprs(dashboard):
        for var in re.findall(r"\$([a-z_]+)", expr):
            assert var in variables or var.startswith("__"), f"undefined variable ${var}"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24
        if panel["type"] != "row":
            assert panel.get("description"), f"panel {panel['title']!r} has no description"
            assert panel["datasource"]["uid"] == "prometheus"


def test_dockerfile_builds_on_cuda_pytorch_with_flashinfer(compose):
    dockerfile = (ROOT / "Dockerfile").read_text()
    base = re.search(r"ARG BASE_IMAGE=(\S+)", dockerfile)
    assert base and base.group(1).startswith("pytorch/pytorch:") and "cuda" in base.group(1)
    assert "-devel" in base.group(1), "FlashInfer's JIT needs nvcc: a devel image"
    assert "pip install '.[cuda,disagg]'" in dockerfile
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("flashinfer") for d in extras["optional-dependencies"]["cuda"])
    assert any(d.startswith("nixl") for d in extras["optional-dependencies"]["disagg"])
    exposed = {int(p) for p in re.findall(r"EXPOSE ([\d ]+)", dockerfile)[0].split()}
    ports = {health_port(svc) for svc in mesh_services(compose).values()}
    assert ports <= exposed
    for svc in mesh_services(compose).values():
        assert svc["build"]["dockerfile"] == "Dockerfile"
    # every package pyproject installs is in the image (the `meshserve` command imports tools/)
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for pattern in packages["packages"]["find"]["include"]:
        name = pattern.rstrip("*")
        assert f"COPY {name} ./{name}" in dockerfile, name
        assert f"{name}/__init__.py" in dockerfile, name
