"""Start-up measurements are kept per machine; those taken while the CPU was busy only until a
start finds it quiet."""

from __future__ import annotations

import time

import pytest

from engine.platforms.cpu import machine_cache


@pytest.fixture(autouse=True)
def private_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("INFERQ_HOME", str(tmp_path / "home"))


def _measure_counting(calls: list[int]):
    def measure() -> dict[str, float]:
        calls.append(1)
        return {"ms": 1.5}

    return measure


def test_a_quiet_measurement_is_kept_for_the_next_start(monkeypatch):
    monkeypatch.setattr(machine_cache, "_others_share", lambda *args: 0.0)
    calls: list[int] = []
    key = machine_cache.machine_key(shapes=[[1, 2]])
    for _ in range(2):
        assert machine_cache.cached("kind", key, _measure_counting(calls), dict) == {"ms": 1.5}
    assert len(calls) == 1
    assert machine_cache.lookup("kind", key, dict) == {"ms": 1.5}


def test_a_measurement_under_load_is_reused_while_busy_and_redone_once_quiet(monkeypatch, caplog):
    # Other processes using the CPU slow the candidates unevenly: such a measurement is only
    # provisional. Starts on a machine still busy reuse it (a restart must not measure for tens
    # of seconds); the first start on a quiet machine measures again and keeps that for good.
    share = {"now": 0.6}
    monkeypatch.setattr(machine_cache, "_others_share", lambda *args: share["now"])
    monkeypatch.setattr(machine_cache, "BUSY_PROBE_S", 0.0)
    monkeypatch.setattr(machine_cache, "PROBE_VALID_S", 0.0)  # each start looks again
    calls: list[int] = []
    key = machine_cache.machine_key(shapes=[[1, 2]])
    with caplog.at_level("INFO", logger="engine.platforms.cpu.machine_cache"):
        for _ in range(2):
            assert machine_cache.cached("kind", key, _measure_counting(calls), dict) == {"ms": 1.5}
    assert len(calls) == 1
    assert machine_cache.lookup("kind", key, dict) == {"ms": 1.5}
    assert "other processes used 60% of the CPU" in caplog.text
    share["now"] = 0.0
    for _ in range(2):
        assert machine_cache.cached("kind", key, _measure_counting(calls), dict) == {"ms": 1.5}
    assert len(calls) == 2  # measured again once, quiet, then kept


def test_the_share_of_other_processes_comes_from_the_tick_counters(monkeypatch):
    monkeypatch.setattr(machine_cache.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(machine_cache.os, "sysconf", lambda name: 100)
    # 1 s on 2 cores = 200 ticks: the machine was busy 180 of them, this process 80.
    assert machine_cache._others_share((1000, 500), (1180, 580), 1.0) == pytest.approx(0.5)
    assert machine_cache._others_share((1000, 500), (1080, 580), 1.0) == 0.0  # only us
    assert machine_cache._others_share(None, (1180, 580), 1.0) == 0.0  # not Linux
    assert machine_cache._others_share((1000, 500), (1180, 580), 0.05) == 0.0  # too short


def test_the_tick_counters_read_this_machine():
    before = machine_cache._cpu_ticks()
    if before is None:
        pytest.skip("no /proc here")
    deadline = time.monotonic() + 0.05
    while time.monotonic() < deadline:
        pass
    after = machine_cache._cpu_ticks()
    assert after is not None and after[0] >= before[0] and after[1] >= before[1]
