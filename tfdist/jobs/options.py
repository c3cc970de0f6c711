"""sbatch's own options: which take a value, so that ``--qos high`` can become ``--qos=high``.

sbatch reads its options with getopt: an option with a required value takes the next word
(``--qos high``, ``-q high``), an option without a value or with an optional one never does
(``--exclusive user`` is ``--exclusive`` and then the script ``user``). The tables below are
sbatch 22.05's, as its getopt reads them; an option they do not list is unknown here,
and ``tfdist job`` asks for its ``--name=value`` form where the next word would be ambiguous.
The launchers' options differ from launcher to launcher: only a few that take no value in every
launcher that has them are known (:data:`LAUNCHER_FLAGS`).
"""

from __future__ import annotations

__all__ = ["LAUNCHER_FLAGS", "SBATCH_FLAGS", "SBATCH_SHORT", "SBATCH_VALUES", "option_name",
           "sbatch_option", "takes_value"]

# Long options that take a value (required_argument).
SBATCH_VALUES = frozenset({
    "--account", "--acctg-freq", "--array", "--batch", "--bb", "--bbf", "--begin", "--chdir",
    "--cluster-constraint", "--clusters", "--comment", "--constraint", "--container",
    "--core-spec", "--cores-per-socket", "--cpu-freq", "--cpus-per-gpu", "--cpus-per-task",
    "--deadline", "--delay-boot", "--dependency", "--distribution", "--error", "--exclude",
    "--export", "--export-file", "--extra-node-info", "--gid", "--gpu-bind", "--gpu-freq",
    "--gpus", "--gpus-per-node", "--gpus-per-socket", "--gpus-per-task", "--gres",
    "--gres-flags", "--hint", "--input", "--job-name", "--kill-on-invalid-dep", "--licenses",
    "--mail-type", "--mail-user", "--mcs-label", "--mem", "--mem-bind", "--mem-per-cpu",
    "--mem-per-gpu", "--mincpus", "--network", "--nodefile", "--nodelist", "--nodes",
    "--ntasks", "--ntasks-per-core", "--ntasks-per-gpu", "--ntasks-per-node",
    "--ntasks-per-socket", "--open-mode", "--output", "--partition", "--power", "--priority",
    "--profile", "--qos", "--reservation", "--signal", "--sockets-per-node", "--switches",
    "--thread-spec", "--threads-per-core", "--time", "--time-min", "--tmp", "--uid", "--wckey",
    "--wrap",
    # newer than 22.05, common on sites' documentation pages
    "--prefer", "--tres-per-task",
})
# Short options that take a value, and their long names.
SBATCH_SHORT = {
    "-A": "--account", "-B": "--extra-node-info", "-C": "--constraint", "-D": "--chdir",
    "-F": "--nodefile", "-G": "--gpus", "-J": "--job-name", "-L": "--licenses",
    "-M": "--clusters", "-N": "--nodes", "-S": "--core-spec", "-a": "--array", "-b": "--begin",
    "-c": "--cpus-per-task", "-d": "--dependency", "-e": "--error", "-i": "--input",
    "-m": "--distribution", "-n": "--ntasks", "-o": "--output", "-p": "--partition",
    "-q": "--qos", "-t": "--time", "-w": "--nodelist", "-x": "--exclude",
}
# Options that never take the next word: no value, or an optional one (--exclusive[=user]).
SBATCH_FLAGS = frozenset({
    "--contiguous", "--exclusive", "--get-user-env", "--help", "--hold", "--ignore-pbs",
    "--nice", "--no-kill", "--no-requeue", "--overcommit", "--oversubscribe", "--parsable",
    "--propagate", "--quiet", "--reboot", "--requeue", "--spread-job", "--test-only", "--usage",
    "--use-min-nodes", "--verbose", "--version", "--wait",
    "-H", "-O", "-Q", "-V", "-W", "-h", "-k", "-s", "-v",
})

# Launcher options without a value: srun's, horovodrun's --gloo, torchrun's --standalone, Open
# MPI's mpirun's. (--mpi is not one: srun's takes a value, horovodrun's does not.)
LAUNCHER_FLAGS = frozenset({
    "--exact", "--overlap", "--label", "--unbuffered", "--whole", "--gloo", "--standalone",
    "--oversubscribe", "--report-bindings", "--tag-output",
})


def option_name(option: str) -> str:
    """The option an sbatch word names: ``--qos`` for ``--qos=high``, ``-t`` for ``-t30``."""
    return option.split("=", 1)[0] if option.startswith("--") else option[:2]


def takes_value(option: str) -> bool | None:
    """Whether sbatch's ``option`` (a bare name, ``--qos`` or ``-q``) takes the next word as its
    value: True, False, or None for an option the tables do not know."""
    if option in SBATCH_VALUES or option in SBATCH_SHORT:
        return True
    if option in SBATCH_FLAGS:
        return False
    return None


def sbatch_option(text: str) -> str:
    """One ``sbatch_args`` item as ``#SBATCH`` takes it: ``--qos high`` and ``-q high`` (an option
    and its value in one word, as written on a command line) become ``--qos=high``.

    Anything else is returned unchanged, for the checks to accept or refuse.
    """
    parts = text.split()
    if len(parts) != 2 or parts[1].startswith("-") or "=" in parts[0]:
        return text
    name, value = parts
    if name in SBATCH_SHORT:
        name = SBATCH_SHORT[name]
    elif not (name.startswith("--") and takes_value(name) is not False):
        return text
    return f"{name}={value}"
