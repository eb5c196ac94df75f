"""The soak benchmark's core (benchmarks/serve_soak.py), small: a few clients for a few seconds
against a real `lmforge serve`, asserting on what happened (counts and statuses, never speed)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

from .serve_helpers import Server, random_checkpoint

spec = importlib.util.spec_from_file_location("serve_soak", Path(__file__).parent.parent / "benchmarks/serve_soak.py")
serve_soak = sys.modules["serve_soak"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(serve_soak)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(random_checkpoint(tmp_path_factory.mktemp("soak")), "--max-batch-size", "4")
    yield s
    s.stop()


def test_mixed_hostile_clients_get_answers_and_health_stays_up(server):
    report = asyncio.run(serve_soak.soak(server.base, server.proc.pid, clients=4, seconds=3, max_tokens=8))
    assert all(report.requests[kind] >= 1 for kind in serve_soak.KINDS)  # each client starts on its own kind
    assert not report.errors and report.server_errors == 0
    assert set(report.statuses) <= {200, 400, 404}
    assert sum(n for s, n in report.statuses.items() if s >= 400) == report.requests["malformed"]
    # every well-formed request that was not cancelled on purpose completed
    assert len(report.latencies) == report.requests["stream"] + report.requests["whole"]
    assert report.health_checks >= 2 and report.health_failures == 0
    assert len(report.rss_kib) >= 2 and min(report.rss_kib) > 0 and serve_soak.memory_is_bounded(report)
    leaking = serve_soak.Report(rss_kib=[100 << 10, 110 << 10, 200 << 10, 300 << 10])  # the check sees a climb
    assert not serve_soak.memory_is_bounded(leaking)
    assert server.proc.poll() is None and serve_soak.passed(report)
