"""The Grafana dashboard (deploy/grafana/narwhal-router.json) reads only what the router
exports: every panel's queries name series of the router's registry, by the names a
Prometheus scrape gives them, grouped and matched by labels those series carry."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

from narwhal.router.metrics import RouterMetrics

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "narwhal-router.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported() -> dict[str, tuple[str, ...]]:
    """Each series name a scrape of the router has (a counter's `_total`, a histogram's
    `_bucket`...), with the labels it carries."""
    m = RouterMetrics()
    labels = {
        w._name: tuple(w._labelnames) for w in vars(m).values() if isinstance(w, MetricWrapperBase)
    }
    out = {}
    for family in m.registry.collect():
        extra = ("le",) if family.type == "histogram" else ()
        for suffix in SUFFIXES[family.type]:
            out[family.name + suffix] = labels.get(family.name, ()) + extra
    return out


def queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert panels
    out = []
    for p in panels:
        assert p["targets"], p["title"]
        out += [(p["title"], t["expr"]) for t in p["targets"]]
    return out


def test_every_panel_reads_series_the_router_exports_by_their_labels() -> None:
    series = exported()
    for title, expr in queries():
        names = re.findall(r"\bnarwhal_[a-z_]+", expr)
        assert names, f"{title}: {expr} reads no series of the router's"
        for name in names:
            assert name in series, f"{title}: {name} is not a series the router exports"
        carried = {label for name in names for label in series[name]}
        grouped = [x.strip() for g in re.findall(r"\bby \(([^)]*)\)", expr) for x in g.split(",")]
        matched = re.findall(r"[{,]\s*([a-z_]+)\s*(?:=|!=|=~|!~)\s*\"", expr)
        for label in grouped + matched:
            assert label in carried, f"{title}: {expr} uses label {label!r}, which {names} lack"


def test_the_dashboard_asks_for_its_prometheus_and_each_panel_uses_it() -> None:
    d = json.loads(DASHBOARD.read_text())
    assert [v["type"] for v in d["templating"]["list"]] == ["datasource"]
    for p in d["panels"]:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
