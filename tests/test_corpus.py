"""The corpus of user-shaped Keras programs (tests/corpus/run.py): its table in docs/corpus.md
holds every program and every run it lists (pure), and a few of its cells, run here on 2 real
workers against one process, give the outcome the table records. The whole corpus is its own
command: ``python tests/corpus/run.py``.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
from helpers import ROOT

from tfdist.verify.compare import CRASHED, DIFFERS, EQUAL, ROUNDING, Verdict

_SPEC = importlib.util.spec_from_file_location("corpus_run", ROOT / "tests" / "corpus" / "run.py")
assert _SPEC is not None and _SPEC.loader is not None
corpus = importlib.util.module_from_spec(_SPEC)
sys.modules["corpus_run"] = corpus  # dataclasses look their module up
_SPEC.loader.exec_module(corpus)

# The cells CI runs: each exercises fixes of several mechanisms at once (see the program's
# docstring); the rest of the corpus runs with its own command.
FAST = [("convnet_mnist", "mwms-k3")]


def test_every_program_names_its_runs_and_the_table_holds_them() -> None:
    listed = corpus.programs()
    assert len(listed) >= 30
    table = corpus.read_table(corpus.DOC.read_text(encoding="utf-8"))
    missing = [(name, run) for name, runs in listed.items() for run in runs
               if (name, run) not in table]
    assert not missing, f"not in docs/corpus.md (run python tests/corpus/run.py --write): {missing}"
    unknown = {cell for cell, outcome in table.items()
               if outcome not in (*corpus.OUTCOMES, "not run")}
    assert not unknown, unknown
    stale = sorted({name for name, _ in table} - set(listed))
    assert not stale, f"docs/corpus.md names programs that are gone: {stale}"


@pytest.mark.parametrize(("verdict", "refused", "expected"), [
    (Verdict(EQUAL, "equal: 4 steps"), False, EQUAL),
    (Verdict(ROUNDING, "within rounding"), False, ROUNDING),
    (Verdict(DIFFERS, "differs first", told=("tfdist: Dropout ...",)), False, corpus.TOLD),
    (Verdict(DIFFERS, "differs first"), False, DIFFERS),
    (Verdict(CRASHED, "failed: tfdist: ... fix ..."), True, corpus.REFUSED),
    (Verdict(CRASHED, "failed: ValueError"), False, CRASHED),
])
def test_outcome(verdict: Verdict, refused: bool, expected: str) -> None:
    assert corpus.outcome(verdict, refused)[0] == expected


def test_the_table_reads_back() -> None:
    cells = [corpus.Cell("a", "mwms-k3", EQUAL, "equal"),
             corpus.Cell("a", "jax", DIFFERS, "differs | first")]
    text = corpus.markdown(cells, {"a": ["mwms-k3", "jax", "hvd-k3"]})
    assert corpus.read_table(text) == {("a", "mwms-k3"): EQUAL, ("a", "jax"): DIFFERS,
                                       ("a", "hvd-k3"): "not run"}
    assert "- `a` on jax: differs: differs \\| first" in text


@pytest.mark.multiprocess
@pytest.mark.parametrize(("name", "run"), FAST)
def test_a_cell_gives_the_tables_outcome(name: str, run: str) -> None:
    expected = corpus.read_table(corpus.DOC.read_text(encoding="utf-8"))[(name, run)]
    cell = corpus.run_cell(name, run)
    assert cell.outcome == expected, cell.line
