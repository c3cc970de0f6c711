"""Slurm hostlist and tasks-per-node expansion, in Slurm's order.

The tables are the specification; python-hostlist (the maintained implementation of the same
grammar, which agrees with ``scontrol show hostnames``) is the oracle of the property test.
"""

from __future__ import annotations

import hostlist as python_hostlist
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tfdist.errors import ConfigError
from tfdist.hostlist import expand_hostlist, expand_tasks_per_node

HOSTLISTS = {
    "single name": ("n1", ["n1"]),
    "zero padding from the written width": ("n[008-011]", ["n008", "n009", "n010", "n011"]),
    "padding kept for a single number": ("n[007]", ["n007"]),
    "range wider than its start": ("n[8-10]", ["n8", "n9", "n10"]),
    "several groups": ("n[1-2],m[3-4]", ["n1", "n2", "m3", "m4"]),
    "suffix after the bracket": ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
    "two bracket groups, rightmost fastest": (
        "rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    "lists and ranges inside brackets": ("a[1,3-4]b", ["a1b", "a3b", "a4b"]),
    "plain names keep their order (never sorted)": ("n9,n10", ["n9", "n10"]),
    "range keeps numeric order": ("n[9-10]", ["n9", "n10"]),
    "bracket-only name": ("[1-2]", ["1", "2"]),
    "duplicates are kept": ("n1,n[1-2],n1", ["n1", "n1", "n2", "n1"]),
    "whitespace around items and range parts is ignored": (
        " n1 , n[2-3, 5] ", ["n1", "n2", "n3", "n5"]),
    "digits before the bracket": ("n1[0-1]", ["n10", "n11"]),
    "whitespace separates hosts, as in Slurm": ("n1 n2\nn[3-4]\tm1", ["n1", "n2", "n3", "n4",
                                                                  "m1"]),
    "a comma and a space are one separator": ("n1, n2", ["n1", "n2"]),
    # As scontrol show hostnames writes them: the last group fastest, then the first, second.
    "three bracket groups, in Slurm's order": ("a[1-2]b[1-2]c[1-2]", [
        "a1b1c1", "a1b1c2", "a2b1c1", "a2b1c2", "a1b2c1", "a1b2c2", "a2b2c1", "a2b2c2"]),
    "four bracket groups, in Slurm's order": ("a[1-2]b[1-2]c[1-2]d[1-2]", [
        "a1b1c1d1", "a1b1c1d2", "a2b1c1d1", "a2b1c1d2", "a1b2c1d1", "a1b2c1d2", "a2b2c1d1",
        "a2b2c1d2", "a1b1c2d1", "a1b1c2d2", "a2b1c2d1", "a2b1c2d2", "a1b2c2d1", "a1b2c2d2",
        "a2b2c2d1", "a2b2c2d2"]),
}


@pytest.mark.parametrize(("expression", "hosts"), HOSTLISTS.values(), ids=HOSTLISTS.keys())
def test_expand_hostlist(expression: str, hosts: list[str]) -> None:
    assert expand_hostlist(expression) == hosts


TASKS_PER_NODE = {
    "repeat then single": ("2(x3),1", [2, 2, 2, 1]),
    "one count": ("4", [4]),
    "single then repeat": ("1,2(x2)", [1, 2, 2]),
    "uneven": ("2,1", [2, 1]),
    "repeat of one": ("3(x1)", [3]),
    "whitespace ignored": (" 2(x2) , 1 ", [2, 2, 1]),
}


@pytest.mark.parametrize(("expression", "counts"), TASKS_PER_NODE.values(),
                         ids=TASKS_PER_NODE.keys())
def test_expand_tasks_per_node(expression: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(expression) == counts


MALFORMED_HOSTLISTS = {
    "unclosed bracket": "n[1-2",
    "close without open": "n1-2]",
    "range runs backwards": "n[2-1]",
    "letters in a range": "n[a-b]",
    "nested brackets": "n[[1]]",
    "empty brackets": "n[]",
    "empty item in a range list": "n[1,]",
    "empty item in the middle": "n1,,n2",
    "trailing comma": "n1,",
    "leading comma": ",n1",
    "blank item": "n1, ,n2",
    "empty expression": "",
    "open-ended range": "n[1-]",
    "non-ASCII digits (Slurm's strtoul rejects them)": "n[\u0661-\u0663]",
}


@pytest.mark.parametrize("expression", MALFORMED_HOSTLISTS.values(),
                         ids=MALFORMED_HOSTLISTS.keys())
def test_malformed_hostlist_raises_config_error_naming_it(expression: str) -> None:
    with pytest.raises(ConfigError) as raised:
        expand_hostlist(expression)
    assert repr(expression) in str(raised.value) or repr(expression.strip()) in str(raised.value)


MALFORMED_TASKS_PER_NODE = ["", "2(x)", "x2", "2(3)", "2,,1", "-1", "2(x3", "\u0662"]


@pytest.mark.parametrize("expression", MALFORMED_TASKS_PER_NODE)
def test_malformed_tasks_per_node_raises_config_error_naming_it(expression: str) -> None:
    with pytest.raises(ConfigError, match="tasks-per-node") as raised:
        expand_tasks_per_node(expression)
    assert repr(expression) in str(raised.value)


# --- python-hostlist as the oracle --------------------------------------------------------
# python-hostlist keeps the written order and, with allow_duplicates=True, the duplicates (as
# Slurm and tfdist do); it differs only where the tables above pin tfdist's stricter choice:
# it silently skips empty items and keeps whitespace inside names. The generator below writes
# neither, so on everything it produces both must agree exactly.

_TEXT = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", max_size=4)


@st.composite
def _range(draw: st.DrawFn) -> str:
    low = draw(st.integers(0, 120))
    width = draw(st.integers(1, 4))  # a width below the number's length means no padding
    start = str(low).zfill(width)
    if draw(st.booleans()):
        return start
    return f"{start}-{low + draw(st.integers(0, 12))}"


@st.composite
def _item(draw: st.DrawFn) -> str:
    groups = draw(st.integers(0, 2))
    text = draw(_TEXT)
    for _ in range(groups):
        ranges = ",".join(draw(st.lists(_range(), min_size=1, max_size=3)))
        text += f"[{ranges}]" + draw(_TEXT)
    # A name needs at least one character; a bare "[..]" item is fine.
    return text or "n"


_HOSTLISTS = st.lists(_item(), min_size=1, max_size=4).map(",".join)


@settings(max_examples=300, deadline=None)
@given(_HOSTLISTS)
@example("n[9-10],n9")
@example("rack[1-2]-n[01-02]-ib")
@example("a[1,3-4]b[098-100]")
def test_expand_hostlist_agrees_with_python_hostlist(expression: str) -> None:
    assert expand_hostlist(expression) == python_hostlist.expand_hostlist(
        expression, allow_duplicates=True)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="n[]-,012", max_size=9))
def test_arbitrary_text_is_accepted_only_where_python_hostlist_accepts_it(text: str) -> None:
    """Fuzz: tfdist never invents hosts from text that is not a hostlist, and never rejects a
    hostlist python-hostlist reads (except empty items, which tfdist rejects on purpose)."""
    try:
        theirs = python_hostlist.expand_hostlist(text, allow_duplicates=True)
    except python_hostlist.BadHostlist:
        theirs = None
    try:
        ours = expand_hostlist(text)
    except ConfigError:
        ours = None
    has_empty_item = text == "" or text.startswith(",") or text.endswith(",") or ",," in text
    if ours is not None:
        assert ours == theirs
    elif theirs is not None:
        assert has_empty_item, f"tfdist rejects {text!r}, python-hostlist reads {theirs}"
