"""The Kubernetes files in deploy/kubernetes/ (docs/operations.md, "Deployment files").

Two kinds of check, both offline:

- **Schemas.** Every manifest is validated, strictly (an unknown field fails), against the
  Kubernetes OpenAPI schemas that ``kubernetes-validate`` ships, for the oldest and the
  newest Kubernetes version the files claim. The ServiceMonitor is a custom resource: it is
  validated against ``tests/data/servicemonitor.schema.json``, the JSON schema of the
  ``ServiceMonitor`` model of the PyPI package ``cloudcoil-models-prometheus-operator``
  0.80.1.0 (generated from prometheus-operator v0.80.1's CRDs; its ``$comment`` says how it
  was written), closed the same way (``additionalProperties: false`` on every object with
  fields).
- **Agreement with the code.** The container arguments are real ``claimkit`` flags; the
  ports and probe paths are the ones ``serve`` answers on with this config; the grace period
  outlasts the drain plus the shutdown's own bounds (taken from the code and from the
  manifests' own config, so changing one without the other fails here).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import typer.main
import yaml
from prometheus_client import CollectorRegistry
from support import free_port
from typer.core import TyperGroup
from typer.testing import CliRunner

from claimkit.cli.app import app
from claimkit.config import load_config
from claimkit.consumer.consumer import CANCEL_GRACE_SECONDS, SWEEP_TIMEOUT_SECONDS
from claimkit.consumer.health import serve_http

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
SERVICE_MONITOR_SCHEMA = Path(__file__).resolve().parent / "data" / "servicemonitor.schema.json"

# The oldest Kubernetes the files are meant for and the newest the pinned validator ships.
KUBERNETES_VERSIONS = ("1.30", "1.37")

# Applied by kustomization.yaml, in its order. secret.example.yaml is validated, never applied.
APPLIED = (
    "configmap.yaml",
    "deployment.yaml",
    "service.yaml",
    "servicemonitor.yaml",
    "pdb.yaml",
    "cronjob.yaml",
)
BUILT_IN = tuple(f for f in (*APPLIED, "secret.example.yaml") if f != "servicemonitor.yaml")

# What ``serve`` may still spend after the flush-and-sweep budget, from the code: closing the
# gateway client (``Consumer._finish``: ``trio.move_on_after(2)``) and joining the HTTP
# servers' thread (``claimkit.consumer.health._Runner.stop``: ``join(timeout=5)``). Both are
# literals there, not importable constants.
TEARDOWN_SECONDS = 2 + 5
# Process exit, the kubelet's own timing: the grace period must beat the sum by this much.
MARGIN_SECONDS = 5


def load(name: str) -> dict[str, Any]:
    """The one YAML document of ``deploy/kubernetes/<name>``."""
    docs = [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d is not None]
    assert len(docs) == 1, name
    doc: dict[str, Any] = docs[0]
    return doc


def pod_spec(name: str) -> dict[str, Any]:
    doc = load(name)
    spec: dict[str, Any] = doc["spec"]
    if doc["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    pod: dict[str, Any] = spec["template"]["spec"]
    return pod


def pod_labels(name: str) -> dict[str, str]:
    doc = load(name)
    spec = doc["spec"]["jobTemplate"]["spec"] if doc["kind"] == "CronJob" else doc["spec"]
    labels: dict[str, str] = spec["template"]["metadata"]["labels"]
    return labels


def container(name: str) -> dict[str, Any]:
    (only,) = pod_spec(name)["containers"]
    c: dict[str, Any] = only
    return c


def transport_json() -> str:
    text: str = load("configmap.yaml")["data"]["transport.json"]
    return text


def command_params(args: list[str]) -> dict[str, Any]:
    """Parse ``claimkit ARGS`` as the image's entrypoint would, without running it: the
    subcommand's parameters by their Python names (raises click's ``NoSuchOption`` for a
    flag ``claimkit`` lacks)."""
    group = typer.main.get_command(app)
    assert isinstance(group, TyperGroup)
    command = group.commands[args[0]]
    return dict(command.make_context(args[0], list(args[1:])).params)


def env_of(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c["env"]}


def mounted_path(name: str, volume_kind: str, key: str) -> str:
    """The path at which container ``name`` sees ``key`` of its ``volume_kind`` volume."""
    pod = pod_spec(name)
    (volume,) = [v for v in pod["volumes"] if volume_kind in v]
    (mount,) = [m for m in container(name)["volumeMounts"] if m["name"] == volume["name"]]
    return f"{mount['mountPath']}/{key}"


# -- schemas ------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name", BUILT_IN)
def test_every_manifest_validates_strictly_against_the_kubernetes_schemas(
    name: str, version: str
) -> None:
    doc = load(name)
    assert kubernetes_validate.validate(doc, version, strict=True) == version


def _closed(node: Any) -> Any:
    """``node`` with ``additionalProperties: false`` on every object schema listing fields."""
    if isinstance(node, dict):
        out = {k: _closed(v) for k, v in node.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_closed(v) for v in node]
    return node


def service_monitor_validator() -> jsonschema.Draft202012Validator:
    schema = _closed(json.loads(SERVICE_MONITOR_SCHEMA.read_text()))
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    return jsonschema.Draft202012Validator(schema)


def test_the_service_monitor_validates_against_the_prometheus_operator_schema() -> None:
    doc = load("servicemonitor.yaml")
    assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
    assert list(service_monitor_validator().iter_errors(doc)) == []


def test_a_misspelt_field_fails_the_kubernetes_schema() -> None:
    doc = copy.deepcopy(load("deployment.yaml"))
    doc["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 60
    with pytest.raises(kubernetes_validate.ValidationError) as caught:
        kubernetes_validate.validate(doc, KUBERNETES_VERSIONS[0], strict=True)
    assert list(caught.value.path) == ["spec", "template", "spec"]
    assert "'terminationGracePeriodSecond' was unexpected" in caught.value.message

    probe = copy.deepcopy(load("deployment.yaml"))
    probe["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["paht"] = "/"
    with pytest.raises(kubernetes_validate.ValidationError) as caught:
        kubernetes_validate.validate(probe, KUBERNETES_VERSIONS[0], strict=True)
    assert "'paht' was unexpected" in caught.value.message


def test_a_wrong_type_fails_the_kubernetes_schema() -> None:
    doc = copy.deepcopy(load("pdb.yaml"))
    doc["spec"]["selector"] = "app.kubernetes.io/name=claimkit"
    with pytest.raises(kubernetes_validate.ValidationError) as caught:
        kubernetes_validate.validate(doc, KUBERNETES_VERSIONS[0], strict=True)
    assert list(caught.value.path) == ["spec", "selector"]


def test_a_misspelt_field_fails_the_service_monitor_schema() -> None:
    doc = copy.deepcopy(load("servicemonitor.yaml"))
    doc["spec"]["endpoints"][0]["prot"] = doc["spec"]["endpoints"][0].pop("port")
    errors = list(service_monitor_validator().iter_errors(doc))
    assert len(errors) == 1
    assert list(errors[0].path) == ["spec", "endpoints", 0]
    assert "'prot' was unexpected" in errors[0].message

    bad_interval = copy.deepcopy(load("servicemonitor.yaml"))
    bad_interval["spec"]["endpoints"][0]["interval"] = "15 seconds"
    errors = list(service_monitor_validator().iter_errors(bad_interval))
    assert [list(e.path) for e in errors] == [["spec", "endpoints", 0, "interval"]]


def test_kustomization_applies_every_manifest_but_the_secret_example() -> None:
    kustomization = load("kustomization.yaml")
    assert kustomization["resources"] == list(APPLIED)
    on_disk = sorted(p.name for p in DEPLOY.glob("*.yaml"))
    assert on_disk == sorted([*APPLIED, "secret.example.yaml", "kustomization.yaml"])


# -- agreement with the code ------------------------------------------------------------------


def test_serve_args_are_serve_flags_and_the_config_loads_with_the_manifest_ports() -> None:
    c = container("deployment.yaml")
    assert c["args"][0] == "serve"
    params = command_params(c["args"])
    config_path = params["transport_config_file"]
    assert config_path == mounted_path("deployment.yaml", "configMap", "transport.json")
    config = load_config(
        inline=transport_json(),
        flags={
            "drain_timeout_seconds": params["drain_timeout"],
            "metrics_port": params["metrics_port"],
            "health_port": params["health_port"],
        },
        environ={"REDIS_URL": "redis://redis.invalid:6379/0"},
    )
    assert config.unknown_fields == ()
    assert [q.queue_name for q in config.queues] == ["requests"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"metrics": config.metrics_port, "health": config.health_port}
    assert ports == {"metrics": 9090, "health": 8081}
    assert config.http_host == "0.0.0.0"  # the kubelet and Prometheus reach the pod IP


def test_a_flag_claimkit_lacks_is_refused_by_the_parse_the_tests_use() -> None:
    # typer carries its own click: its NoSuchOption is not importable by a public name.
    with pytest.raises(Exception, match=r"^No such option: --transport-config-fil") as caught:
        command_params(["serve", "--transport-config-fil", "/etc/claimkit/transport.json"])
    assert type(caught.value).__name__ == "NoSuchOption"


def test_probes_use_the_paths_and_port_serve_answers() -> None:
    c = container("deployment.yaml")
    probes = {k: c[k]["httpGet"] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes == {
        "startupProbe": {"path": "/healthz", "port": "health"},
        "livenessProbe": {"path": "/healthz", "port": "health"},
        "readinessProbe": {"path": "/readyz", "port": "health"},
    }
    # The same paths, asked of claimkit's own servers (on free ports: 8081 may be taken here).
    metrics_port, health_port = free_port(), free_port()
    with serve_http(
        metrics_port=metrics_port,
        health_port=health_port,
        registry=CollectorRegistry(),
        ready=lambda: (True, "ok"),
        host="127.0.0.1",
    ):
        base = f"http://127.0.0.1:{health_port}"
        assert httpx.get(f"{base}/healthz").status_code == 200
        assert httpx.get(f"{base}/readyz").status_code == 200
        monitor = load("servicemonitor.yaml")["spec"]["endpoints"][0]
        scrape = httpx.get(f"http://127.0.0.1:{metrics_port}{monitor['path']}")
        assert scrape.status_code == 200
        assert scrape.headers["content-type"].startswith("text/plain")


def test_the_grace_period_outlasts_drain_and_sweep() -> None:
    c = container("deployment.yaml")
    params = command_params(c["args"])
    config = load_config(
        inline=transport_json(),
        flags={"drain_timeout_seconds": params["drain_timeout"]},
        environ={"REDIS_URL": "redis://redis.invalid:6379/0"},
    )
    shutdown_bound = (
        config.drain_timeout_seconds
        + CANCEL_GRACE_SECONDS
        + SWEEP_TIMEOUT_SECONDS  # the acks' flush and the sweep share it
        + TEARDOWN_SECONDS
    )
    # docs/operations.md and deployment.yaml's comment quote these figures: update them too.
    assert (config.drain_timeout_seconds, shutdown_bound) == (30.0, 48.0)
    grace = pod_spec("deployment.yaml")["terminationGracePeriodSeconds"]
    assert grace >= shutdown_bound + MARGIN_SECONDS
    # SIGTERM is handled by serve itself (the image's entrypoint is claimkit): no hook.
    assert "lifecycle" not in c


def test_the_consumer_id_is_the_pod_name() -> None:
    env = env_of(container("deployment.yaml"))
    assert env["CLAIMKIT_CONSUMER_ID"] == {
        "name": "CLAIMKIT_CONSUMER_ID",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
    }


def test_the_consumer_id_flag_reads_the_variable_the_manifest_sets() -> None:
    group = typer.main.get_command(app)
    assert isinstance(group, TyperGroup)
    params = {p.name: p for p in group.commands["serve"].params}
    assert getattr(params["consumer_id"], "envvar", None) == "CLAIMKIT_CONSUMER_ID"
    # The manifest passes no --consumer-id of its own: the variable is the one source.
    assert not any(str(a).startswith("--consumer-id") for a in container("deployment.yaml")["args"])


@pytest.mark.parametrize("name", ["deployment.yaml", "cronjob.yaml"])
def test_the_redis_url_comes_from_the_secret_file(name: str) -> None:
    env = env_of(container(name))
    secret = load("secret.example.yaml")
    (key,) = secret["stringData"]
    assert env["REDIS_URL_FILE"]["value"] == mounted_path(name, "secret", key)
    (volume,) = [v for v in pod_spec(name)["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    assert volume["secret"]["defaultMode"] == 0o440
    raw = json.loads(transport_json())
    # A url or url_file in the JSON would win over the file.
    assert "url" not in raw
    assert "url_file" not in raw
    assert "CHANGE-ME" in secret["stringData"][key]  # a placeholder, never a real secret


def test_the_pods_run_as_non_root_on_a_read_only_root() -> None:
    for name in ("deployment.yaml", "cronjob.yaml"):
        pod = pod_spec(name)
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["automountServiceAccountToken"] is False
        assert container(name)["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
        resources = container(name)["resources"]
        assert set(resources) == {"requests", "limits"}


def test_service_monitor_pdb_and_service_select_the_consumer_pods() -> None:
    pods = pod_labels("deployment.yaml")
    deployment_selector = load("deployment.yaml")["spec"]["selector"]["matchLabels"]
    service = load("service.yaml")
    pdb_selector = load("pdb.yaml")["spec"]["selector"]["matchLabels"]
    for selector in (deployment_selector, service["spec"]["selector"], pdb_selector):
        assert selector.items() <= pods.items()
    # The reclaim job's pods are not consumers: neither the Service nor the budget counts them.
    assert not service["spec"]["selector"].items() <= pod_labels("cronjob.yaml").items()
    budget = {"maxUnavailable": 1, "selector": {"matchLabels": pdb_selector}}
    assert load("pdb.yaml")["spec"] == budget

    (port,) = service["spec"]["ports"]
    assert (port["name"], port["targetPort"]) == ("metrics", "metrics")
    container_ports = {p["name"]: p["containerPort"] for p in container("deployment.yaml")["ports"]}
    assert port["port"] == container_ports["metrics"]
    monitor = load("servicemonitor.yaml")["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["endpoints"]] == ["metrics"]


def test_the_reclaim_cron_job_runs_reclaim_once_without_overlap() -> None:
    cron = load("cronjob.yaml")["spec"]
    assert cron["schedule"] == "* * * * *"  # docs/operations.md's cron line
    assert cron["concurrencyPolicy"] == "Forbid"
    assert 0 < cron["startingDeadlineSeconds"] < 60  # a missed minute is skipped, not stacked
    c = container("cronjob.yaml")
    params = command_params(c["args"])
    assert c["args"][:2] == ["reclaim", "--once"]
    assert params["once"] is True
    assert params["transport_config_file"] == container("deployment.yaml")["args"][2]
    assert pod_spec("cronjob.yaml")["restartPolicy"] == "Never"
    # The same config and secret as the consumers.
    assert pod_spec("cronjob.yaml")["volumes"] == pod_spec("deployment.yaml")["volumes"][:2]


def test_the_cron_jobs_command_runs_against_redis_with_the_manifest_config(
    redis_url: str, tmp_path: Path
) -> None:
    """The CronJob's arguments and environment, run for real: the config file and the
    secret's file at temporary paths, Redis the test server."""
    config_file = tmp_path / "transport.json"
    config_file.write_text(transport_json())
    url_file = tmp_path / "url"
    url_file.write_text(redis_url + "\n")
    c = container("cronjob.yaml")
    args = [str(config_file) if a == "/etc/claimkit/transport.json" else a for a in c["args"]]
    assert args != c["args"]
    result = CliRunner().invoke(app, args, env={"REDIS_URL": None, "REDIS_URL_FILE": str(url_file)})
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == (
        "claimkit reclaim: queues=1 redelivered=0 dead_lettered=0 ghosts=0 leases_restored=0 "
        "handed_on=0"
    )


def test_the_readme_names_every_file() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for name in (*APPLIED, "secret.example.yaml", "kustomization.yaml"):
        assert re.search(rf"`{re.escape(name)}`", readme), name
