"""The walltime guard: where a run's end comes from, the margin, and the agreement that stops
every rank in time (tfdist/walltime.py, tfdist.preemption.Watch). Pure tables and a fake clock
here; real runs stopped by ``tfdist launch --time-limit`` are in test_preemption.py, a Slurm
job at its time limit in test_slurm_jobs.py.
"""

from __future__ import annotations

import datetime
import logging
import threading

import pytest

from tfdist import preemption, walltime
from tfdist.env import ClusterEnvironment, detect
from tfdist.errors import ConfigError

NOW = 1_800_000_000.0


@pytest.mark.parametrize(("text", "bare", "seconds"), [
    ("90s", "s", 90), ("90 sec", "s", 90), ("10min", "s", 600), ("10m", "s", 600),
    ("2h", "s", 7200), ("1d", "s", 86400), ("1.5h", "s", 5400), ("45", "s", 45),
    ("45", "min", 2700),  # a bare number is minutes, as for sbatch --time
    ("05:30", "s", 330), ("1:00:00", "s", 3600), ("2-12", "s", 2 * 86400 + 12 * 3600),
    ("1-00:30", "s", 86400 + 1800), ("1-01:02:03", "s", 86400 + 3600 + 120 + 3),
    (" 2H ", "s", 7200),
])
def test_parse_duration(text, bare, seconds):
    assert walltime.parse_duration(text, bare=bare) == seconds


@pytest.mark.parametrize("text", ["", "0", "0s", "-5s", "soon", "10 parsecs", "1:2:3:4", "5y"])
def test_parse_duration_refuses_with_the_forms(text):
    with pytest.raises(ValueError, match="write 90s, 10min, 2h, 1d"):
        walltime.parse_duration(text)


@pytest.mark.parametrize(("text", "expected"), [
    ("2026-11-26T14:03:00", datetime.datetime(2026, 11, 26, 14, 3).timestamp()),
    ("Unknown", None), ("N/A", None), ("NONE", None), ("", None),
])
def test_parse_squeue_end(text, expected):
    assert walltime.parse_squeue_end(text) == expected


@pytest.mark.parametrize(("end", "source", "expected"), [
    (NOW + 3600, "SLURM_JOB_END_TIME", (NOW + 3600, "SLURM_JOB_END_TIME")),
    (NOW - 5, "TFDIST_END_TIME", (NOW - 5, "TFDIST_END_TIME")),  # past: stop at once
    (None, None, (None, "no TFDIST_END_TIME or SLURM_JOB_END_TIME")),
    (0.0, "SLURM_JOB_END_TIME", (None, "SLURM_JOB_END_TIME=0: no time limit")),
    (NOW + 400 * 86400, "SLURM_JOB_END_TIME",
     (None, f"SLURM_JOB_END_TIME={NOW + 400 * 86400:.0f}: no time limit")),
])
def test_end_from(end, source, expected):
    assert walltime.end_from(end, source, NOW) == expected


@pytest.mark.parametrize(("environ", "end", "source"), [
    ({"SLURM_JOB_END_TIME": "1800003600"}, 1800003600.0, "SLURM_JOB_END_TIME"),
    ({"SLURM_JOB_END_TIME": "1800003600", "TFDIST_END_TIME": "1800000060.5"}, 1800000060.5,
     "TFDIST_END_TIME"),  # tfdist launch --time-limit inside an allocation: the launch's
    ({"SLURM_JOB_END_TIME": "garbage"}, None, None),
    ({}, None, None),
])
def test_detection_carries_the_end(environ, end, source):
    found = detect(environ)
    assert (found.end_time, found.end_time_from) == (end, source)


def test_a_malformed_tfdist_end_time_is_refused_with_its_meaning():
    with pytest.raises(ConfigError, match="TFDIST_END_TIME='tomorrow' is no time: seconds since"):
        detect({"TFDIST_END_TIME": "tomorrow"})


@pytest.mark.parametrize(("save", "gap", "override", "expected"), [
    (0.0, 0.0, None, walltime.FLOOR_S),  # nothing timed yet: the floor
    (2.0, 1.0, None, walltime.FLOOR_S),  # 2*2 + 2*1 + 10 = 16 < 60
    (40.0, 5.0, None, 2 * 40 + 2 * 5 + walltime.EXIT_S),  # a slow save sets it
    (40.0, 5.0, 25.0, 25.0),  # TFDIST_WALLTIME_MARGIN wins
])
def test_margin(save, gap, override, expected):
    assert walltime.margin(save, gap, override) == expected


def test_the_clock_follows_a_job_extended_while_it_runs(caplog):
    now = [NOW]
    answers = [NOW + 600, NOW + 4200]  # scontrol update TimeLimit=+60 between two reads
    asked = threading.Event()

    def reread():
        asked.set()
        return answers.pop(0) if answers else None

    clock = walltime.Clock(NOW + 600, "SLURM_JOB_END_TIME", reread, every=0.01,
                           now=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="tfdist"):
        clock.start()
        assert asked.wait(5)
        for _ in range(500):
            if clock.end == NOW + 4200:
                break
            threading.Event().wait(0.01)
        clock.stop()
    assert clock.end == NOW + 4200 and clock.source == "squeue"
    assert clock.left() == 4200
    assert "the job's end moved by +3600 s" in caplog.text


class _Agreeing:
    """One process that agrees with itself (the sums are its own values)."""

    world_size, is_chief = 1, True
    environment = ClusterEnvironment(launcher="single")

    def sum_over_ranks(self, values):
        return [float(v) for v in values]


@pytest.mark.parametrize(("left", "margin", "stops"), [
    (3600.0, 60.0, False), (61.0, 60.0, False), (60.0, 60.0, True), (-5.0, 60.0, True)])
def test_the_watch_stops_every_rank_when_the_time_left_reaches_the_margin(
        monkeypatch, caplog, left, margin, stops):
    monkeypatch.setenv("TFDIST_WALLTIME_MARGIN", str(margin))
    clock = walltime.Clock(NOW + left, "TFDIST_END_TIME", now=lambda: NOW)
    watch = preemption.Watch(_Agreeing(), check_seconds=3600, clock=clock)
    with caplog.at_level(logging.WARNING, logger="tfdist"):
        assert watch.step() is stops  # step 1 checks
    assert watch.walltime is stops and watch.signal is None
    if stops:
        assert f"walltime: {left:.0f} s left before this run's end (from TFDIST_END_TIME), " \
               f"the margin is {margin:.0f} s" in caplog.text
        assert "after step 1, saves and exits 75" in caplog.text


def test_without_an_end_the_watch_waits_for_signals_only():
    watch = preemption.Watch(_Agreeing(), check_seconds=3600,
                             clock=walltime.Clock(None, "no TFDIST_END_TIME"))
    assert not any(watch.step() for _ in range(100)) and not watch.walltime


def test_the_margin_grows_with_the_saves_timed(monkeypatch):
    monkeypatch.delenv("TFDIST_WALLTIME_MARGIN", raising=False)
    monkeypatch.setattr(walltime, "_longest", [0.0])
    clock = walltime.Clock(NOW + 100, "TFDIST_END_TIME", now=lambda: NOW)
    assert not preemption.Watch(_Agreeing(), check_seconds=3600, clock=clock).step()  # 100 > 60
    walltime.record_save(30.0)  # 2 * 30 + 10 + twice a gap of about 0 s: 70 s
    walltime.record_save(None)  # a state that recorded no time changes nothing
    assert walltime.longest_save() == 30.0
    assert not preemption.Watch(_Agreeing(), check_seconds=3600, clock=clock).step()
    walltime.record_save(45.0)  # 100 s
    assert preemption.Watch(_Agreeing(), check_seconds=3600, clock=clock).step()


def test_only_the_chief_keeps_a_clock():
    class Worker(_Agreeing):
        is_chief = False

    assert preemption.Watch(Worker(), check_seconds=1).clock is None


def test_a_safety_save_is_agreed_at_a_check_and_training_goes_on():
    watch = preemption.Watch(_Agreeing(), check_seconds=3600,
                             clock=walltime.Clock(None, "none"), every=1e-9)
    assert not watch.step() and watch.save_now  # step 1 checks: a save is due
    watch.saved()
    assert not watch.save_now
    assert not watch.step() and not watch.save_now  # step 2 runs no check
    assert not watch.step() and watch.save_now  # step 3 does (the interval doubled)
    assert not watch.step() and not watch.save_now  # one step only, saved or not
    never = preemption.Watch(_Agreeing(), check_seconds=3600,
                             clock=walltime.Clock(None, "none"))
    assert not any(never.step() or never.save_now for _ in range(40))
