"""Short versions of the campaigns (``python -m gyrfalcon.campaigns``) on the tiny model: what they
count must hold; their speed figures are printed, not asserted (the full campaigns check those)."""

from __future__ import annotations

import sys

import pytest

from gyrfalcon.bench.server import launch
from gyrfalcon.campaigns import abuse, sigterm, slow_clients, soak

pytestmark = pytest.mark.live


def test_slow_clients_do_not_stall_the_server(live_server):
    report = slow_clients.run(live_server.url, idle=150, one_byte=150, non_reading=20, repeat=3)
    print("\n".join(report.lines()))
    # a server whose threads the slow clients held would not answer at all (the old front: 45 s)
    assert report.health_beside_ms < 2000 and report.beside_s < 30


def test_soak_of_mixed_valid_and_invalid_requests(live_server):
    report = soak.run(live_server.url, requests=280, concurrency=4)
    print("\n".join(report.lines()))
    assert report.met(), report.failures[:10]
    assert sum(v for k, v in report.statuses.items() if k.startswith("4")) == 280 // 5


def test_sigterm_under_load(tiny_model_dir, tmp_path):
    argv = lambda port: [  # noqa: E731
        sys.executable, "-m", "gyrfalcon.cli", "serve", "--port", str(port), "--model", tiny_model_dir, "--max-model-len",
        "128", "--max-num-seqs", "2", "--num-threads", "1", "--drain-timeout", "1", "--enforce-eager"]  # fmt: skip
    server = launch(argv, str(tmp_path / "server.log"), timeout_s=180)
    try:
        report = sigterm.run(server, requests=48)  # enough queued to outlast a /metrics render a second old
    finally:
        server.stop()
    print("\n".join(report.lines()))
    assert report.met(), report.failures
    assert report.outcomes["503"] >= 8 - 2 and report.exit_s < 1 + 10


def test_attacks_are_refused_cheaply_and_lose_nothing(live_server):
    """The abuse campaign, short: each attack refused (4xx) or served, never a 5xx or a dropped
    connection, alone and beside a normal client whose every request is answered; stored responses
    get the server's ids. A refusal found in quadratic time would take seconds of CPU, and a cache
    or a reference cycle that kept the refused bodies some 30 MiB; the p99
    figures are printed (the campaign holds that target on the default model)."""
    report = abuse.run(live_server.url, live_server.process.pid, schemas=20, schema_bytes=512 << 10, normal_requests=8)
    print("\n".join(report.lines()))
    assert not report.failures and report.server_errors() == 0
    assert set(report.normal) == {200}
    assert len(report.statuses) == 11 and all(report.statuses.values())
    assert max(report.cpu_s.values()) < 10 * abuse.CPU_PER_ATTACK_S, report.cpu_s
    assert report.rss_growth is not None and report.rss_growth < 16 << 20  # the cycle kept 31 MiB here, fixed +0.1
