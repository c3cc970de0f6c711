"""tfdist.savetime: whether a save of the state fits the time a run has for it; the bandwidth
measured in model_dir; the doctor's save-time budget."""

from __future__ import annotations

import json

import pytest

from tfdist import savetime
from tfdist.doctor import marks


@pytest.mark.parametrize(("size", "rate", "seconds"), [
    (1_000_000_000, 500.0, 2.0),
    (0, 100.0, 0.0),
    (10, 0.0, float("inf")),
])
def test_a_saves_time_is_its_size_over_the_bandwidth(size, rate, seconds):
    assert savetime.estimate_s(size, rate) == seconds


@pytest.mark.parametrize(("save", "lead"), [(0.0, 10), (0.2, 11), (25.0, 60), (25.01, 61)])
def test_the_lead_a_save_needs_is_twice_it_and_the_exit(save, lead):
    assert savetime.needed_lead_s(save) == lead


FITS = {  # name: (save seconds, keyword arguments, the limits named)
    "nothing known": (500.0, {}, []),
    "a fast save fits everything": (1.0, {"lead_s": 60, "margin_s": 60, "every_s": 60}, []),
    "longer than the lead time": (30.0, {"lead_s": 60}, ["TFDIST_SIGNAL_LEAD"]),
    "just fits the lead time": (25.0, {"lead_s": 60}, []),
    "a margin set too short": (30.0, {"margin_s": 60}, ["TFDIST_WALLTIME_MARGIN"]),
    "saves half the interval": (31.0, {"every_s": 60}, ["TFDIST_CHECKPOINT_EVERY"]),
    "all three": (100.0, {"lead_s": 60, "margin_s": 60, "every_s": 60},
                  ["TFDIST_SIGNAL_LEAD", "TFDIST_WALLTIME_MARGIN", "TFDIST_CHECKPOINT_EVERY"]),
}


@pytest.mark.parametrize("name", sorted(FITS))
def test_each_limit_a_save_does_not_fit_is_named_with_its_fix(name):
    save, limits, named = FITS[name]
    found = savetime.problems(save, **limits)
    assert [next(v for v in ("TFDIST_SIGNAL_LEAD", "TFDIST_WALLTIME_MARGIN",
                             "TFDIST_CHECKPOINT_EVERY") if v in what) for what, _ in found] == named
    for what, fix in found:
        assert f"{save:.1f} s" in what and fix


def test_the_fixes_give_numbers_that_fit_and_offer_background_saves_only_when_off():
    (_, lead_fix), (_, margin_fix), (_, every_fix) = savetime.problems(
        100.0, lead_s=60, margin_s=60, every_s=60)
    assert "--signal=USR1@210" in lead_fix and "at least 210 s" in margin_fix
    assert "TFDIST_CHECKPOINT_EVERY to 400s" in every_fix
    assert "TFDIST_BACKGROUND_SAVES=1" in lead_fix
    assert not savetime.problems(100.0 / 2.1 - 5, lead_s=110)  # within its own fix: fits
    (_, fix), = savetime.problems(30.0, lead_s=60, background=True)
    assert "TFDIST_BACKGROUND_SAVES" not in fix


def test_the_bandwidth_is_measured_in_the_folder_and_leaves_nothing(tmp_path):
    rate = savetime.measure_mb_per_s(str(tmp_path), mb=4)
    assert rate > 0
    assert list(tmp_path.iterdir()) == []


def _saved(model_dir, size, took=None):
    folder = model_dir / "preempted"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "variables.bin").write_bytes(b"\0" * size)
    state = json.dumps({"epoch": 0, **({"save_seconds": took} if took is not None else {})})
    (folder / "state.json").write_text(state)
    return size + len(state)


def test_the_state_size_is_the_last_complete_saves(tmp_path):
    assert savetime.state_bytes(str(tmp_path)) is None
    (tmp_path / ".preempted.partial-3").mkdir()  # never committed: not a save
    (tmp_path / ".preempted.partial-3" / "variables.bin").write_bytes(b"\0" * 100)
    assert savetime.state_bytes(str(tmp_path)) is None
    size = _saved(tmp_path, 5000)
    assert savetime.state_bytes(str(tmp_path)) == size


def test_the_doctor_times_model_dir_and_names_a_lead_time_too_short(tmp_path, monkeypatch):
    line, found = marks.save_time(str(tmp_path))
    assert "MB/s" in line and "no save there yet" in line and not found
    _saved(tmp_path, 4 << 20)
    monkeypatch.setenv("TFDIST_SIGNAL_LEAD", "60")
    line, found = marks.save_time(str(tmp_path))
    assert "the last save there, 4 MB, would take about" in line and not found  # fits
    monkeypatch.setattr(savetime, "measure_mb_per_s", lambda folder: 0.1)  # a slow disk's rate
    line, found = marks.save_time(str(tmp_path))
    assert "0 MB/s" in line and "would take about 41.9 s" in line
    (problem,) = found
    assert problem.severity == "warning" and "TFDIST_SIGNAL_LEAD" in problem.line()
    assert "--signal=USR1@94" in problem.line()


def test_the_doctor_takes_the_time_the_last_save_took_where_longer_than_the_estimate(
        tmp_path, monkeypatch):
    _saved(tmp_path, 4 << 20, took=40.0)  # Keras's file: slower than the disk's bandwidth
    monkeypatch.setenv("TFDIST_SIGNAL_LEAD", "60")
    assert savetime.recorded_s(str(tmp_path)) == 40.0
    line, (problem,) = marks.save_time(str(tmp_path))
    assert "would take about 40.0 s (it took 40.0 s when it was made)" in line
    assert "--signal=USR1@90" in problem.line()
