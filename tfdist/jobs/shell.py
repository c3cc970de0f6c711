"""Putting values into a job script safely: shell words for the body, checked #SBATCH values.

The body of a job script is read by bash, so every value goes through :func:`word`: it is
single-quoted by :func:`shlex.quote`, except ``${NAME}`` references, which the job's shell expands
(``--model_dir=${SCRATCH}/run-${SLURM_JOB_ID}``). Nothing else expands: ``$(...)``, backticks,
``$NAME`` without braces, ``~``, globs, quotes, ``;`` and newlines arrive byte for byte.

``#SBATCH`` lines are not read by bash but by sbatch itself (``_get_argument`` in Slurm's
``src/sbatch/opt.c``): it splits at whitespace, removes quotes and backslashes and treats ``#`` as
the start of a comment. A value with those characters would reach Slurm altered, or inject another
directive after a newline, so :func:`check_sbatch_value` refuses them instead of escaping them.
"""

from __future__ import annotations

import re
import shlex

from tfdist.errors import ConfigError

__all__ = ["SBATCH_FORBIDDEN", "check_sbatch_value", "check_body_value", "word", "words"]

_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
# Printable ASCII only. sbatch reads whitespace, quotes, backslashes and '#' itself; '$' and '~'
# are refused because sbatch expands neither (--output=$HOME/x would write under a directory
# literally named "$HOME").
SBATCH_FORBIDDEN = " \"'\\#$`~"


def word(value: str) -> str:
    """Return ``value`` as one shell word that bash reads back byte for byte.

    ``${NAME}`` (braces and a plain variable name) stays a reference that the job's shell
    expands, double-quoted so its value is neither split nor globbed.
    """
    parts, pos = [], 0
    for match in _REFERENCE.finditer(value):
        if match.start() > pos:
            parts.append(_quote(value[pos : match.start()]))
        parts.append(f'"${{{match.group(1)}}}"')
        pos = match.end()
    if pos < len(value) or not parts:
        parts.append(_quote(value[pos:]))
    return "".join(parts)


def _quote(text: str) -> str:
    # Single quotes, except around '$' and '`': there double quotes with backslashes read the
    # same and tell shellcheck the text is meant literally (no SC2016 in rendered scripts).
    # shlex.quote('') is "''", an empty argument.
    if text.startswith("~"):  # a backslash keeps it literal, and shellcheck quiet (SC2088)
        return "\\~" + (_quote(text[1:]) if len(text) > 1 else "")
    if not any(ch in text for ch in "$`"):
        return shlex.quote(text)
    escaped = "".join(f"\\{ch}" if ch in '\\"$`' else ch for ch in text)
    return f'"{escaped}"'


def words(values: list[str] | tuple[str, ...]) -> str:
    """Return ``values`` as shell words joined by spaces (see :func:`word`)."""
    return " ".join(word(value) for value in values)


def check_body_value(key: str, value: str) -> None:
    """Refuse what no shell word can carry: a NUL byte.

    Raises:
        ConfigError: ``value`` contains a NUL byte.
    """
    if "\0" in value:
        raise ConfigError(f"{key}: {value!r} contains a NUL byte, which no shell argument or "
                          "environment variable can hold; remove it")


def check_sbatch_value(key: str, value: str) -> None:
    """Check that ``value`` reaches Slurm unchanged on an ``#SBATCH`` line.

    Raises:
        ConfigError: ``value`` is empty or has whitespace, a control or non-ASCII character, or
            one of ``" ' \\ # $ ` ~``, with the characters that are allowed.
    """
    bad = sorted({c for c in value if not " " < c <= "~" or c in SBATCH_FORBIDDEN})
    if value and not bad:
        return
    what = "is empty" if not value else f"contains {', '.join(repr(c) for c in bad)}"
    hint = ""
    if "$" in bad or "~" in bad:
        hint = (" sbatch does not expand variables or '~' there: write the path out, or use "
                "Slurm's patterns such as %u (user), %x (job name) and %j (job id).")
    raise ConfigError(
        f"{key}: {value!r} {what}. It goes on an #SBATCH line, which sbatch splits at whitespace "
        "and where it removes quotes and backslashes and starts a comment at '#'; use printable "
        f"ASCII without spaces or any of {' '.join(SBATCH_FORBIDDEN.strip())}.{hint}")
