"""The monitoring files in deploy/ (docs/operations.md#alerts, docs/operations.md#dashboard):
the Prometheus alert rules pass ``promtool check rules`` and their unit tests
(``promtool test rules``: each alert fires and does not fire), every metric the rules and
the Grafana dashboard name is one claimkit exports, the queue-wide gauges are read through
``max``/``min by (queue_name)`` and the per-process counters through ``sum``, and every
runbook pointer lands on a section of docs/operations.md.

promtool is Debian's ``prometheus`` package (``.ci/run`` installs it): where it is missing
the promtool tests are skipped, but under CI (``CI`` set) they fail."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from prometheus_tools import binary
from test_docs import anchors

from claimkit.consumer.metrics import Metrics
from claimkit.ops.reclaim_metrics import reclaim_registry
from claimkit.protocol.stats import QUEUE_GAUGES

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "claimkit-alerts.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "claimkit-alerts.test.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "claimkit-dashboard.json"
OPERATIONS = ROOT / "docs" / "operations.md"
NS = "llm_d_async_"

ALERTS = [
    "ClaimkitConsumerDownWithClaims",
    "ClaimkitClaimsExpiringUnreclaimed",
    "ClaimkitOldestPendingNearDeadline",
    "ClaimkitDeadLettersGrowing",
    "ClaimkitDuplicatesSuppressed",
    "ClaimkitGatewayBreakerOpen",
]
QUEUE_WIDE = {NS + name for _attr, name, _doc in QUEUE_GAUGES}
METRIC = re.compile(r"\b(llm_d_async_[A-Za-z0-9_]+)")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary("promtool"), *args],
        cwd=RULES.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.slow
def test_promtool_check_rules() -> None:
    result = promtool("check", "rules", RULES.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout


@pytest.mark.slow
def test_promtool_test_rules() -> None:
    result = promtool("test", "rules", RULE_TESTS.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_the_alerts_and_their_runbooks() -> None:
    found = rules()
    assert [r["alert"] for r in found] == ALERTS
    sections = anchors(OPERATIONS.read_text(encoding="utf-8"))
    for rule in found:
        notes = rule["annotations"]
        assert set(notes) == {"summary", "description", "runbook"}, rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        page, _, anchor = notes["runbook"].partition("#")
        assert page == "docs/operations.md"
        assert anchor == rule["alert"].lower()
        assert anchor in sections, f"docs/operations.md has no section #{anchor}"


def test_every_alert_has_a_case_that_fires_and_one_that_does_not() -> None:
    doc = yaml.safe_load(RULE_TESTS.read_text())
    assert doc["rule_files"] == [RULES.name]
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in doc["tests"]:
        for check in case["alert_rule_test"]:
            (fires if check["exp_alerts"] else quiet).add(check["alertname"])
    assert fires == quiet == set(ALERTS)


def exported_names() -> set[str]:
    """Every series name claimkit exports: ``serve``'s registry and ``reclaim --once``'s."""
    registries: list[CollectorRegistry] = [Metrics().registry, reclaim_registry({}, {}, 0.0)]
    names: set[str] = set()
    suffixes = {
        "counter": ("_total", "_created"),
        "gauge": ("",),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
    }
    for registry in registries:
        for family in registry.collect():
            names.update(family.name + s for s in suffixes[family.type])
    return names


def dashboard_exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in doc["templating"]["list"] if "definition" in v]
    return exprs


def test_every_metric_named_in_the_rules_and_the_dashboard_is_exported() -> None:
    known = exported_names()
    assert NS + "async_queue_pending" in known
    assert NS + "async_terminal_records_total" in known
    assert NS + "async_reclaim_last_run_redelivered" in known
    named = {
        m for expr in [r["expr"] for r in rules()] + dashboard_exprs() for m in METRIC.findall(expr)
    }
    assert named - known == set()
    # The dashboard shows every queue-wide gauge and the new counters.
    shown = {m for expr in dashboard_exprs() for m in METRIC.findall(expr)}
    assert QUEUE_WIDE | {NS + "async_terminal_records_total", NS + "claimkit_build_info"} <= shown


def _aggregations(expr: str) -> list[tuple[str, str]]:
    """``(metric, the aggregation around it)`` for each metric in ``expr``: the text just
    before it, up to the last ``by (...) (`` or function call."""
    out = []
    for match in METRIC.finditer(expr):
        before = expr[: match.start()]
        agg = re.findall(r"(\w+ by \([\w, ]+\) \()(?:\w+\()?$", before)
        out.append((match.group(1), agg[0] if agg else before[-30:]))
    return out


def test_queue_wide_gauges_are_folded_with_max_or_min_and_counters_summed() -> None:
    exprs = [r["expr"] for r in rules()] + dashboard_exprs()[:-1]  # not the label query
    for expr in exprs:
        for metric, agg in _aggregations(expr):
            if metric in QUEUE_WIDE:
                assert agg in ("max by (queue_name) (", "min by (queue_name) ("), (metric, expr)
            elif metric.endswith(("_total", "_bucket")):
                assert agg.startswith("sum by ("), (metric, expr)


def test_ci_installs_the_prometheus_packages() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"apt-get install[^\n]* prometheus prometheus-pushgateway", ci)
