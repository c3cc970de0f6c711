"""A save exists when it returns, on every rank: one real 2-worker MWMS launch (Keras 3) of
tests/workers/saves_worker.py, whose ranks load what they just saved without a wait of their
own (tfdist.keras.writers).

Before the fix rank 1 returned from ``model.save`` while the chief was still writing (a load
there found no file, or the round before's), and a path per rank was never written on rank 1
(its save went to a scratch copy): this worker recorded 20 failed loads of 20 on rank 1 and no
``own-1`` files, in 2 runs of 2. With the paths compared but no barrier after the writes, 3 to 6
loads of 20 failed on rank 1 in each of 3 runs. The control is the reference for paths per
rank: the same saves inside ``tfdist.per_rank_files()`` (each rank writes as given) must give
the same answer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import WORKERS, clean_env, launch

pytestmark = pytest.mark.multiprocess

ROUNDS, WEIGHT_ROUNDS = 20, 5


class Run:
    def __init__(self, out: Path) -> None:
        self.out, self.tmp = out, out / "tmp"
        self.tmp.mkdir(parents=True)
        # Keras 3; TMPDIR: where the other rank's scratch copies go (they must be gone after)
        env = clean_env(TF_USE_LEGACY_KERAS="0", TMPDIR=str(self.tmp))
        self.job = launch([str(WORKERS / "saves_worker.py"), str(out)], env=env, timeout=120)
        self.output = self.job.stdout + self.job.stderr
        assert self.job.returncode == 0, self.output[-6000:]
        self.results = [json.loads((out / f"result-{rank}.json").read_text())
                        for rank in (0, 1)]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return Run(tmp_path_factory.mktemp("saves"))


def _rounds_that_failed(loaded: list[Any]) -> dict[int, Any]:
    return {i: found for i, found in enumerate(loaded) if found != float(i)}


def test_every_rank_loads_the_file_just_saved_on_one_path(run):
    for rank, result in enumerate(run.results):
        assert len(result["same_path"]) == ROUNDS, result
        assert _rounds_that_failed(result["same_path"]) == {}, (rank, result["same_path"])
        assert len(result["same_weights"]) == WEIGHT_ROUNDS, result
        assert _rounds_that_failed(result["same_weights"]) == {}, (rank,
                                                                   result["same_weights"])
    assert {p.name for p in run.out.glob("same*")} == {"same.keras", "same.weights.h5"}
    assert not [p.name for p in run.out.iterdir() if p.name.startswith(".")], "partial files"
    assert not list(run.tmp.iterdir()), "scratch copies left behind"
    assert ("[0] tfdist: model.save('" + str(run.out / "same.keras") + "') on every rank: the "
            "chief writes it") in run.output, run.output[-4000:]


def test_each_rank_writes_its_own_path_as_per_rank_files_does(run):
    every = {"0": [100.0, 100.0], "1": [101.0, 101.0]}  # each rank's file: its own bias
    for rank, result in enumerate(run.results):
        own, reference = result["own_path"], result["per_rank_files"]
        assert reference == {"mine": [100.0 + rank] * 2, "every": every}, (rank, reference)
        assert own == reference, (rank, own)
    assert sorted(p.name for p in run.out.glob("own-*")) == [
        "own-0.keras", "own-0.weights.h5", "own-1.keras", "own-1.weights.h5"]
    # The line the chief shows is true of its own path and names what the others do.
    assert ("[0] tfdist: model.save('" + str(run.out / "own-0.keras") + "'): the ranks gave 2 "
            "different paths; each is written once") in run.output, run.output[-4000:]


def test_one_path_for_every_rank_inside_per_rank_files_is_written_whole_and_said(run):
    # Every rank saves shared/one.keras inside per_rank_files(): each writes a temporary name and
    # renames it, so every load finds a whole model (one rank's or the other's), and the chief
    # names the slip once, with the fix.
    for result in run.results:
        assert result["shared"] in (100.0, 101.0), result
    said = [line for line in run.output.splitlines() if "one.keras" in line]
    assert len(said) == 1 and said[0].startswith("[0] tfdist: model.save(") and \
        "the path names no rank, so every rank writes this one file" in said[0], said
