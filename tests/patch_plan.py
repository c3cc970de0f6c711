"""What a real run installed against what tfdist's patch inventory plans for it.

The workers of the real-process tests (``train_worker.py`` under MWMS and Horovod,
``keras_jax_worker.py`` under Keras 3 on JAX) record ``patches``: the keys the process installed
(``tfdist.patches.installed()``, in the order first applied) and the keys the inventory plans
for its launch, by phase (``tfdist.patches.planned(plan, phase)``). The tests hold them together
here, so a row installed without being planned, planned without being installed, or installed
in another order than the inventory's fails the run that showed it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def assert_installed_as_planned(record: Mapping[str, Any], reached: Sequence[str] = (),
                                not_reached: Sequence[str] = ()) -> None:
    """The process installed the import's planned row (tfdist.autostart), the creation's, then
    the start's, in the inventory's
    order, then ``reached``: the rows of the later phases (``call``, ``lazy``) that its own
    calls installed, in that order. Every planned row of a later phase is accounted for, in
    ``reached`` or in ``not_reached`` (planned, but the run made no call that installs it)."""
    planned = record["planned"]
    assert record["installed"] == [*planned.get("import", []), *planned["create"],
                                   *planned["start"], *reached], record
    later = [*planned["call"], *planned["lazy"]]
    assert sorted([*reached, *not_reached]) == sorted(later), (
        f"the later phases' rows {later} must each be reached or not: {record}")
