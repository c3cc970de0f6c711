"""The walltime guard: where a run's end comes from, the margin, and the agreement that stops
every rank in time (tfdist/walltime.py, tfdist.preemption.Watch), the durations it reads
(tfdist/durations.py), and the refusal of a run it would stop at its first agreement (no restart
loop). Pure tables and a fake clock here, and one refused 2-worker launch; real runs stopped by
``tfdist launch --time-limit`` are in test_preemption.py, a Slurm job at its time limit in
test_slurm_jobs.py.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from helpers import ROOT, WORKERS, clean_env

from tfdist import durations, launch, preemption, walltime
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
    assert durations.parse_duration(text, bare=bare) == seconds


@pytest.mark.parametrize("text", ["", "0", "0s", "-5s", "soon", "10 parsecs", "1:2:3:4", "5y"])
def test_parse_duration_refuses_with_the_forms(text):
    with pytest.raises(ValueError, match="write 90s, 10min, 2h, 1d"):
        durations.parse_duration(text)


# One dialect of durations across the options and job keys (the settings: test_settings.py):
# each takes 90s, 10min, 2h; a bare number keeps the unit its name gives (SECONDS, or minutes
# where sbatch --time reads it).
OPTIONS = [  # (arguments, the option's destination, seconds)
    (["launch", "--grace-period", "1min", "-n", "1", "x.py"], "grace_period", 60.0),
    (["launch", "--grace-period", "2.5", "-n", "1", "x.py"], "grace_period", 2.5),
    (["launch", "--time-limit", "90", "-n", "1", "x.py"], "time_limit", 5400.0),
    (["launch", "--time-limit", "90s", "-n", "1", "x.py"], "time_limit", 90.0),
    (["doctor", "--timeout", "2min"], "timeout", 120.0),
    (["verify", "--timeout", "1h", "x.py"], "timeout", 3600.0),
    (["survive", "--min-nodes", "1", "--tasks-per-node", "1", "--probe-timeout", "45s", "--",
      "srun", "x"],
     "probe_timeout", 45.0),
]


@pytest.mark.parametrize(("argv", "name", "seconds"), OPTIONS, ids=lambda v: str(v))
def test_every_duration_option_reads_one_dialect(argv, name, seconds):
    from tfdist.cli import build_parser

    assert getattr(build_parser().parse_args(argv), name) == seconds


@pytest.mark.parametrize(("key", "given", "kept"), [
    ("time", "90min", "01:30:00"), ("time", "2h", "02:00:00"), ("time", "36h", "1-12:00:00"),
    ("time", "90", "90"), ("time", "1-00:00:00", "1-00:00:00"),  # sbatch's own forms as given
    ("signal", "USR1@2min", "USR1@120"), ("signal", "USR1@120", "USR1@120"),
])
def test_the_job_keys_read_the_durations_dialect_as_sbatch_writes_it(key, given, kept):
    from tfdist.jobs.config import JobConfig

    config = JobConfig.from_mapping({"script": "train.py", key: given})
    assert getattr(config, key) == kept


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
    now = [NOW]
    clock = walltime.Clock(NOW + 7200, "TFDIST_END_TIME", now=lambda: now[0])
    watch = preemption.Watch(_Agreeing(), check_seconds=3600, clock=clock)
    assert not watch.step()  # step 1 checks: the run's first agreement, two hours left
    now[0] = NOW + 7200 - left
    with caplog.at_level(logging.WARNING, logger="tfdist"):
        assert watch.check() is stops
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


# --- no restart loop: a run the guard would stop at its first agreement is refused ----------

LAUNCHED = "tfdist launch --time-limit, or whatever sets TFDIST_END_TIME"
DEFAULT = ("the default: twice the longest save and twice the time between two agreements, "
           "plus 10 s, at least 60 s")


@pytest.mark.parametrize(("started", "left", "margin", "source", "margin_set", "signalled",
                          "expected"), [
    (3600.0, 3590.0, 60.0, "TFDIST_END_TIME", True, False, None),
    (70.0, 61.0, 60.0, "TFDIST_END_TIME", True, False, None),  # a second left past the margin
    # The loop: `tfdist launch --time-limit 60s` with a margin of 120 s trained one step,
    # saved, exited 75 and started again, every run.
    (50.0, 49.0, 120.0, "TFDIST_END_TIME", True, False,
     "walltime: the margin, 120 s (TFDIST_WALLTIME_MARGIN), is at or above the 50 s this run "
     "had left when its training began (its end from TFDIST_END_TIME): the walltime guard would "
     "stop every run at its first step and start it again, without end; refused, nothing saved "
     f"or requeued. Set TFDIST_WALLTIME_MARGIN below 49 s or give the run a longer time limit "
     f"({LAUNCHED})"),
    # A signal there does not save the run from a margin above all of its time ...
    (50.0, 49.0, 120.0, "TFDIST_END_TIME", True, True, "is at or above the 50 s"),
    (60.0, 60.0, 60.0, "squeue", False, False,  # at most the margin: as the stop
     f"the margin, 60 s ({DEFAULT}), is at or above the 60 s this run had left"),
    # Below the margin at the first step only: starting up took the rest.
    (90.0, 55.0, 60.0, "SLURM_JOB_END_TIME", False, False,
     "walltime: this run made no progress since its last start: 55 s were left at its first "
     f"step (its end from SLURM_JOB_END_TIME), within the margin, 60 s ({DEFAULT}), of the 90 s "
     "it had when its training began, and every restart would stop there again; refused, "
     "nothing saved or requeued. Set TFDIST_WALLTIME_MARGIN below 55 s or give the run a longer "
     "time limit (sbatch --time)"),
    # ... but a preemption signal at the first step is no loop: stopped and requeued as ever.
    (90.0, 55.0, 60.0, "SLURM_JOB_END_TIME", False, True, None),
    (10.0, -5.0, 60.0, "?", True, False,  # past the end already: only more time helps
     "nothing saved or requeued. Give the run a longer time limit (the job's time limit)"),
])
def test_refusal(started, left, margin, source, margin_set, signalled, expected):
    found = walltime.refusal(started, left, margin, source, margin_set, signalled)
    if expected is None or expected.startswith("walltime: "):  # the whole line, else a part
        assert found == expected
    else:
        assert found is not None and expected in found, found


@pytest.mark.parametrize(("source", "number"), [
    ("TFDIST_END_TIME", 1.0), ("SLURM_JOB_END_TIME", 2.0), ("squeue", 3.0), ("?", 0.0),
    ("no TFDIST_END_TIME or SLURM_JOB_END_TIME", 0.0)])
def test_the_end_source_travels_as_a_number(source, number):
    assert walltime.source_number(source) == number
    assert walltime.source_named(number) == (source if number else "?")


@pytest.mark.parametrize(("code", "restart", "restarts", "again", "line"), [
    (0, 0, 2, False, None),
    (75, 0, 2, True, "restarting all workers (1 of --max-restarts 2) after a preemption"),
    (1, 1, 2, True, "restarting all workers (2 of --max-restarts 2) after exit code 1"),
    (75, 2, 2, False, "giving up after 2 restart(s): the last run ended with code 75"),
    (walltime.EXIT_REFUSED, 0, 2, False,
     "not restarting (--max-restarts 2): a worker exited 78, an error in the script's set-up "
     "that tfdist named above, and every run would stop there again"),
    (walltime.EXIT_REFUSED, 0, 0, False, None), (1, 0, 0, False, None),
    (130, 0, 2, False, None), (143, 0, 2, False, None),
])
def test_the_launch_restarts_neither_a_refusal_nor_past_its_limit(code, restart, restarts,
                                                                   again, line):
    assert launch.next_run(code, restart, restarts) == (again, line)


def test_the_refusal_comes_at_the_first_agreement_only(monkeypatch, caplog):
    monkeypatch.setenv("TFDIST_WALLTIME_MARGIN", "120")
    clock = walltime.Clock(NOW + 50, "TFDIST_END_TIME", now=lambda: NOW)
    with pytest.raises(ConfigError, match=r"^walltime: the margin, 120 s \(TFDIST_WALLTIME_MARG"):
        preemption.Watch(_Agreeing(), check_seconds=3600, clock=clock).step()
    # Later agreements of the run (here a second fit's, on the process's clock) stop and save
    # as ever: by then the run has trained.
    later = preemption.Watch(_Agreeing(), check_seconds=3600, clock=clock)
    with caplog.at_level(logging.WARNING, logger="tfdist"):
        assert later.step() and later.walltime
    assert "walltime: 50 s left before this run's end" in caplog.text


def test_a_signal_at_the_first_agreement_stops_and_requeues_as_ever(monkeypatch):
    monkeypatch.setenv("TFDIST_WALLTIME_MARGIN", "60")
    now = [NOW]
    clock = walltime.Clock(NOW + 90, "SLURM_JOB_END_TIME", now=lambda: now[0])
    now[0] += 35  # starting up took 35 s: 55 s left at the first step
    watch = preemption.Watch(_Agreeing(), check_seconds=3600, clock=clock, catch=[])
    watch.signal = signal.SIGUSR1
    assert watch.step() and watch.stop_requested and not watch.walltime  # a preemption's stop


class _Pair:
    """Two ranks in two threads of this process; ``sum_over_ranks`` adds their values."""

    def __init__(self) -> None:
        self.values: list[list[float]] = [[], []]
        self.barrier = threading.Barrier(2, timeout=10)  # a rank left alone fails, not hangs

    def rank(self, rank: int) -> Any:
        pair = self

        class Rank(_Agreeing):
            world_size, is_chief = 2, rank == 0

            def sum_over_ranks(self, values):
                pair.values[rank] = [float(v) for v in values]
                pair.barrier.wait()
                total = [a + b for a, b in zip(*pair.values, strict=True)]
                pair.barrier.wait()
                return total

        return Rank()


def test_every_rank_refuses_alike_on_the_chiefs_clock(monkeypatch):
    # Only the chief keeps a clock: its time left, the time at its start and where its end came
    # from reach rank 1 in the agreement, which raises the same line.
    monkeypatch.delenv("TFDIST_WALLTIME_MARGIN", raising=False)
    monkeypatch.setattr(walltime, "_longest", [0.0])
    pair, raised = _Pair(), {}
    chief_clock = walltime.Clock(NOW + 45, "squeue", now=lambda: NOW)

    def run(rank: int) -> None:
        watch = preemption.Watch(pair.rank(rank), check_seconds=3600,
                                 clock=chief_clock if rank == 0 else None)
        try:
            watch.step()
        except ConfigError as error:
            raised[rank] = str(error)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert raised[0] == raised[1] == walltime.refusal(45, 45, 60, "squeue", False), raised


REFUSED_SCRIPT = """
import sys
from tfdist import preemption, walltime
from tfdist.env import ClusterEnvironment

class One:
    world_size, is_chief, rank = 1, True, 0
    environment = ClusterEnvironment(launcher="single")

    def sum_over_ranks(self, values):
        return [float(v) for v in values]

clock = walltime.Clock(float(sys.argv[1]), "SLURM_JOB_END_TIME")
watch = preemption.Watch(One(), check_seconds=3600, clock=clock)
try:
    watch.step()
except Exception:
    if sys.argv[2] == "caught":
        sys.exit(0)
    raise
"""


@pytest.mark.parametrize(("caught", "code"), [("uncaught", walltime.EXIT_REFUSED),
                                              ("caught", 0)])
def test_a_refused_run_exits_78_unless_the_script_catches_the_error(caught, code):
    # 78, not 1: `tfdist launch --max-restarts` restarts a failure, and the run would only stop
    # there again. A script that catches the error decides its own exit.
    run = subprocess.run([sys.executable, "-c", REFUSED_SCRIPT, str(time.time() + 30), caught],
                         cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60,
                         check=False)
    assert run.returncode == code, run.stderr[-3000:]
    if caught == "uncaught":  # one line, no traceback (tfdist.uncaught)
        assert run.stderr.splitlines()[-1].startswith(
            "tfdist: walltime: the margin, 60 s (the default: "), run.stderr
        assert "Traceback" not in run.stderr, run.stderr


@pytest.mark.multiprocess
def test_a_margin_above_the_time_limit_is_refused_on_every_rank_and_not_restarted(tmp_path):
    # The restart loop: a margin of 120 s in a 60 s run trained one step, saved, exited
    # 75 and started again, every run (a Slurm job requeued itself TFDIST_MAX_REQUEUES times).
    out, model = tmp_path / "out", tmp_path / "model"
    out.mkdir()
    run = subprocess.run(
        [sys.executable, "-m", "tfdist", "launch", "--time-limit", "60s", "--max-restarts", "2",
         "-n", "2", str(WORKERS / "preempt_worker.py"), str(out), str(model), "mwms", "-1", "0"],
        cwd=ROOT, env=clean_env(TFDIST_WALLTIME_MARGIN="120", TF_CPP_MIN_LOG_LEVEL="2",
                                PYTHONUNBUFFERED="1"),
        capture_output=True, text=True, timeout=180, check=False)
    output = run.stdout[-4000:] + run.stderr[-2000:]
    assert run.returncode == walltime.EXIT_REFUSED, output
    lines = re.findall(r"^\[(\d)\] tfdist: (walltime: .*)$", run.stdout, re.M)
    # Every rank found it: rank 0 says it, once, and no rank prints a traceback.
    assert [rank for rank, _ in lines] == ["0"], output
    assert "Traceback" not in run.stdout, output
    assert re.fullmatch(r"walltime: the margin, 120 s \(TFDIST_WALLTIME_MARGIN\), is at or above "
                        r"the \d+ s this run had left when its training began \(its end from "
                        r"TFDIST_END_TIME\): .*; refused, nothing saved or requeued\. Set "
                        r"TFDIST_WALLTIME_MARGIN below \d+ s or give the run a longer time "
                        rf"limit \({re.escape(LAUNCHED)}\)", lines[0][1]), lines[0][1]
    assert "restarting all workers" not in run.stderr, output
    assert "not restarting (--max-restarts 2): a worker exited 78" in run.stderr, output
    assert sorted(p.name for p in out.iterdir()) == ["result-0-0.json", "result-1-0.json"]
    results = [json.loads((out / f"result-{rank}-0.json").read_text()) for rank in (0, 1)]
    assert [r["steps"] for r in results] == [1, 1], results  # refused at the first step
    assert not list(model.glob("preempted*"))  # nothing saved


@pytest.mark.parametrize(("took", "every", "said"), [
    (0.04, None, False), (0.04, 600.0, False),  # the example's saves: no line
    (1.5, None, True), (1.5, 600.0, True),  # over a second
    (0.2, 2.0, True), (0.09, 2.0, False),  # over 5 % of a 2 s interval, or under
])
def test_a_safety_save_says_a_line_only_when_slow(took, every, said):
    assert preemption.slow_save(took, every) is said
