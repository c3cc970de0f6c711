"""Slurm hostlist and task-count expressions, expanded in Slurm's own order.

``n[01-03],login1`` -> ``n01 n02 n03 login1`` and ``2(x3),1`` -> ``2 2 2 1``.

The order matters: Slurm numbers the nodes of a step in nodelist order, and every task must
derive the same rank-to-node table from it. TensorFlow's stock SlurmClusterResolver sorts the
names as strings, which puts ``n10`` before ``n9`` and hangs the job.

We implement the grammar here instead of depending on python-hostlist (the maintained
library for it) because that package is GPL-2+, which does not combine with tfdist's Apache
licence; the tests use it as an oracle, and on a real cluster ``scontrol show hostnames``.
"""

from __future__ import annotations

import itertools
import re

from tfdist.errors import ConfigError

__all__ = ["expand_hostlist", "expand_tasks_per_node"]

# [0-9], not \d: \d also matches other scripts' digits (Arabic-Indic "n[\u0661-\u0663]"),
# which Slurm's strtoul rejects.
_RANGE = re.compile(r"^([0-9]+)(?:-([0-9]+))?$")
_REPEAT = re.compile(r"^([0-9]+)(?:\(x([0-9]+)\))?$")


def expand_hostlist(expression: str) -> list[str]:
    """Expands a Slurm hostlist such as ``n[1-2]-ib,rack[1-2]-n[01-02]`` in Slurm's order.

    Supports items separated by commas or whitespace, several bracket groups per name (in
    Slurm's order: the last varies fastest, then the first, the second, ...), lists and ranges
    inside brackets, zero padding taken from the written width, and text after a bracket.
    Duplicates are kept, as Slurm keeps them in a step's nodelist.

    Raises:
        ConfigError: the expression is not a hostlist.
    """
    return [host for item in _split_top_level(expression) for host in _expand_item(item)]


def expand_tasks_per_node(expression: str) -> list[int]:
    """Expands ``SLURM_STEP_TASKS_PER_NODE`` syntax, e.g. ``2(x3),1`` -> ``[2, 2, 2, 1]``.

    Raises:
        ConfigError: the expression is malformed.
    """
    counts: list[int] = []
    for item in expression.split(","):
        match = _REPEAT.match(item.strip())
        if not match:
            raise ConfigError(f"cannot parse tasks-per-node expression {expression!r}: "
                              f"expected items like '2' or '2(x3)', got {item!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _split_top_level(expression: str) -> list[str]:
    # Commas and, as in Slurm, whitespace (spaces, newlines) separate items outside brackets.
    items: list[str] = []
    depth, current, after_comma = 0, "", True
    for char in expression:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth not in (0, 1):
            raise _bad(expression, "brackets are unbalanced or nested")
        if depth == 0 and char == ",":
            if not current and after_comma:
                raise _bad(expression, "it has an empty item")
            if current:
                items.append(current)
            current, after_comma = "", True
        elif depth == 0 and char.isspace():
            if current:
                items.append(current)
                current, after_comma = "", False
        else:
            current += char
    if depth:
        raise _bad(expression, "a '[' is never closed")
    if current:
        items.append(current)
    elif after_comma:
        raise _bad(expression, "it has an empty item")
    return items


def _expand_item(item: str) -> list[str]:
    # "rack[1-2]-n[01-02]" -> ["rack", "1-2", "-n", "01-02", ""]: text at even positions,
    # bracket contents at odd ones.
    parts = re.split(r"\[([^\]]*)\]", item)
    texts, groups = parts[0::2], [_expand_ranges(text, item) for text in parts[1::2]]
    # Slurm's order (scontrol show hostnames): the last group varies fastest, then the first,
    # the second, ...: a[1-2]b[1-2]c[1-2] -> a1b1c1 a1b1c2 a2b1c1 a2b1c2 a1b2c1 ... With one
    # or two groups that is the plain product, rightmost fastest.
    order = [*range(len(groups) - 2, -1, -1), len(groups) - 1] if len(groups) > 2 else \
        list(range(len(groups)))
    hosts = []
    for combo in itertools.product(*(groups[i] for i in order)):
        values = dict(zip(order, combo, strict=True))
        hosts.append(texts[0] + "".join(values[i] + texts[i + 1] for i in range(len(groups))))
    return hosts


def _expand_ranges(ranges: str, item: str) -> list[str]:
    values: list[str] = []
    for part in ranges.split(","):
        match = _RANGE.match(part.strip())
        if not match:
            raise _bad(item, f"{part!r} is not a number or a range like 01-10")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise _bad(item, f"range {part!r} runs backwards")
        width = len(low)
        values += [str(n).zfill(width) for n in range(int(low), int(high) + 1)]
    return values


def _bad(expression: str, why: str) -> ConfigError:
    return ConfigError(f"cannot expand hostlist {expression!r}: {why}")
