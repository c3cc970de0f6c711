"""Tests of ``tfdist launch`` and the ``tfdist`` command line.

The pure builders are checked as tables; everything else runs real worker processes (small
Python scripts, no TensorFlow) through ``python -m tfdist`` or :func:`tfdist.launch.launch`;
``--dry-run`` runs in this process with starting a process made to fail.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, NoReturn

import pytest

import tfdist.launch
import tfdist.supervisor
from tfdist.cli import build_parser, main
from tfdist.devices import node_gpus, select_gpus, share
from tfdist.doctor.report import ranges
from tfdist.env import detect
from tfdist.errors import ConfigError
from tfdist.launch import (
    assign_cpus,
    build_command,
    build_horovod_workers,
    build_workers,
    check_command,
    env_changes,
    exit_code,
    format_plan,
    free_ports,
    launch,
    log_path,
    port_range,
    split_lines,
    tf_config,
    worker_env,
)

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
CORES = sorted(os.sched_getaffinity(0))
multiprocess = pytest.mark.multiprocess  # Starts real worker processes on loopback.
needs_two_cores = pytest.mark.skipif(
    len(CORES) < 2, reason=f"pinning needs >= 2 cores to give distinct cores; have {CORES}"
)

# Rank 0 records its pid (atomically) and sleeps; rank 1 waits for that pid, then exits with
# the code in argv[2]. With --ignore-term rank 0 ignores SIGTERM.
FAIL_SCRIPT = """
import os, pathlib, signal, sys, time
pidfile = pathlib.Path(sys.argv[1])
if os.environ["TFDIST_LOCAL_RANK"] == "0":
    if "--ignore-term" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pidfile.with_suffix(".tmp").write_text(str(os.getpid()))
    pidfile.with_suffix(".tmp").rename(pidfile)
    time.sleep(60)
deadline = time.monotonic() + 10
while not pidfile.exists() and time.monotonic() < deadline:
    time.sleep(0.02)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(sys.argv[2]))
"""

# Every rank records its pid in argv[1]/pid<rank> and sleeps.
SLEEP_SCRIPT = """
import os, pathlib, sys, time
tmp = pathlib.Path(sys.argv[1], "tmp" + os.environ["TFDIST_LOCAL_RANK"])
tmp.write_text(str(os.getpid()))
tmp.rename(tmp.with_name("pid" + os.environ["TFDIST_LOCAL_RANK"]))
time.sleep(60)
"""


def _script(tmp_path: Path, body: str, name: str = "worker.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=30, check=False
    )


def _tfdist(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return _run([PY, "-m", "tfdist", *args], _env(**extra))


def _lines(stdout: str, rank: int) -> list[str]:
    """The output lines of worker ``rank``, without their prefix."""
    head = f"[{rank}] "
    return [line[len(head) :] for line in stdout.splitlines() if line.startswith(head)]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, waiting to be reaped, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_for(path: Path, timeout: float = 10) -> int:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    return int(path.read_text())


# -- Pure part ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "args", "module", "expected"),
    [
        ("train.py", ["--epochs=3"], False, (PY, "train.py", "--epochs=3")),
        ("dir/train.py", [], False, (PY, "dir/train.py")),
        ("pkg.mod", ["a", "-n", "2"], True, (PY, "-m", "pkg.mod", "a", "-n", "2")),
        ("echo", ["hi"], False, ("echo", "hi")),
        ("./run.sh", ["--x"], False, ("./run.sh", "--x")),
    ],
)
def test_build_command(
    target: str, args: list[str], module: bool, expected: tuple[str, ...]
) -> None:
    assert build_command(target, args, module=module) == expected


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_tf_config_names_every_worker_and_this_task(rank: int) -> None:
    text = tf_config([5000, 5001, 6000], rank)
    assert " " not in text
    assert json.loads(text) == {
        "cluster": {"worker": ["127.0.0.1:5000", "127.0.0.1:5001", "127.0.0.1:6000"]},
        "task": {"type": "worker", "index": rank},
    }


def test_worker_env_replaces_tf_config_and_keeps_the_rest() -> None:
    base = {"TF_CONFIG": '{"old": 1}', "HOME": "/home/u", "PYTHONUNBUFFERED": "0"}
    env = worker_env(base, [7000, 7001], 1)
    assert json.loads(env["TF_CONFIG"])["task"] == {"type": "worker", "index": 1}
    assert env["HOME"] == "/home/u"
    assert {k: env[k] for k in env if k.startswith("TFDIST_") or k == "PYTHONUNBUFFERED"} == {
        "TFDIST_LAUNCHER": "local",
        "TFDIST_LOCAL_RANK": "1",
        "TFDIST_LOCAL_WORLD_SIZE": "2",
        "PYTHONUNBUFFERED": "1",
    }
    assert base["TF_CONFIG"] == '{"old": 1}'  # The parent's mapping is left alone.


def test_build_workers_gives_each_rank_its_config_and_cores() -> None:
    cpus = [frozenset({0}), frozenset({1}), frozenset({0})]
    workers = build_workers(3, ["prog", "--flag"], [9000, 9001, 9002], {"A": "b"}, cpus)
    assert [w.rank for w in workers] == [0, 1, 2]
    assert all(w.argv == ("prog", "--flag") and w.env["A"] == "b" for w in workers)
    assert [json.loads(w.env["TF_CONFIG"])["task"]["index"] for w in workers] == [0, 1, 2]
    assert [w.env["TFDIST_LOCAL_RANK"] for w in workers] == ["0", "1", "2"]
    assert [w.cpus for w in workers] == cpus
    assert build_workers(1, ["prog"], [9000], {})[0].cpus is None


@pytest.mark.parametrize(
    ("num_workers", "ports", "cpus"),
    [(0, [], None), (2, [9000], None), (2, [9000, 9001], [frozenset({0})])],
)
def test_build_workers_rejects_inconsistent_input(
    num_workers: int, ports: list[int], cpus: list[frozenset[int]] | None
) -> None:
    with pytest.raises(ConfigError):
        build_workers(num_workers, ["prog"], ports, {}, cpus)


@pytest.mark.parametrize(
    ("num_workers", "cores", "per_worker", "expected"),
    [
        (2, [3, 1], None, [{1}, {3}]),
        (2, [0, 1, 2, 3], None, [{0}, {1}]),
        (3, [0, 1], None, [{0}, {1}, {0}]),  # More workers than cores: round robin.
        (2, [0, 1, 2, 3], 2, [{0, 1}, {2, 3}]),
        (2, [8, 4, 5, 6, 7], 2, [{4, 5}, {6, 7}]),
        (1, [0, 1, 2], 3, [{0, 1, 2}]),
    ],
)
def test_assign_cpus(
    num_workers: int, cores: list[int], per_worker: int | None, expected: list[set[int]]
) -> None:
    assert assign_cpus(num_workers, cores, per_worker) == [frozenset(c) for c in expected]


@pytest.mark.parametrize(
    ("num_workers", "cores", "per_worker", "message"),
    [(2, [0, 1, 2], 2, "needs 4 cores but 3 are available"), (1, [], None, "--no-pin")],
)
def test_assign_cpus_says_the_fix(
    num_workers: int, cores: list[int], per_worker: int | None, message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        assign_cpus(num_workers, cores, per_worker)


@pytest.mark.parametrize(
    ("base", "count", "expected"),
    [(1024, 1, [1024]), (29500, 3, [29500, 29501, 29502]), (65534, 2, [65534, 65535])],
)
def test_port_range(base: int, count: int, expected: list[int]) -> None:
    assert port_range(base, count) == expected


@pytest.mark.parametrize(("base", "count"), [(1023, 1), (80, 2), (65535, 2), (70000, 1)])
def test_port_range_rejects_ports_outside_1024_65535(base: int, count: int) -> None:
    with pytest.raises(ConfigError, match=f"between 1024 and {65536 - count}"):
        port_range(base, count)


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = free_ports(16)
    assert len(set(ports)) == 16
    assert all(1024 <= port <= 65535 for port in ports)


@pytest.mark.parametrize(
    ("buffer", "lines", "rest"),
    [
        (b"a\nb", [b"a"], b"b"),
        (b"a\r\nb\n", [b"a", b"b"], b""),
        (b"\n\n", [b"", b""], b""),  # Blank lines stay.
        (b"10%\r20%\r", [b"10%"], b"20%\r"),  # A final \r may start \r\n.
        (b"20%\r\n", [b"20%"], b""),
        (b"\rstep 1\r\rstep 2\n", [b"step 1", b"step 2"], b""),  # Empty \r lines go.
    ],
)
def test_split_lines(buffer: bytes, lines: list[bytes], rest: bytes) -> None:
    assert split_lines(buffer) == (lines, rest)


@pytest.mark.parametrize(("returncode", "code"), [(0, 0), (3, 3), (-9, 137), (-15, 143)])
def test_exit_code(returncode: int, code: int) -> None:
    assert exit_code(returncode) == code


def test_log_path_is_one_file_per_rank(tmp_path: Path) -> None:
    assert log_path(tmp_path, 3) == tmp_path / "rank-3.log"
    assert log_path("logs", 0) == Path("logs", "rank-0.log")


@pytest.mark.parametrize(
    ("base", "env", "changes"),
    [
        ({"A": "1"}, {"A": "1"}, {}),
        ({"A": "1"}, {"A": "1", "B": "2"}, {"B": "2"}),  # Added.
        ({"A": "1"}, {"A": "2"}, {"A": "2"}),  # Changed.
        ({"A": "1", "TF_CONFIG": "{}"}, {"A": "1"}, {"TF_CONFIG": None}),  # Removed.
        ({}, {"Z": "", "B": "x y"}, {"B": "x y", "Z": ""}),  # Sorted; an empty value is one.
    ],
)
def test_env_changes(
    base: dict[str, str], env: dict[str, str], changes: dict[str, str | None]
) -> None:
    assert env_changes(base, env) == changes
    assert list(env_changes(base, env)) == sorted(changes)


@pytest.mark.parametrize(
    ("command", "error"),
    [
        ([PY, "worker.py", "--x"], None),
        ([PY, "sub/missing.py"], "script 'sub/missing.py' not found"),
        ([PY, "-m", "json.tool"], None),
        ([PY, "-m", "mymod"], None),  # Found in the working folder, as python -m finds it.
        ([PY, "-m", "no_such_module_tfdist.sub"], "module 'no_such_module_tfdist.sub' not found"),
        ([PY, "-c", "pass"], None),  # Python's own options: the interpreter is the target.
        (["sh", "-c", "true"], None),
        (["no-such-program-tfdist"], "'no-such-program-tfdist' is not an executable on PATH"),
        (["./run.sh", "--x"], None),
        (["./data.txt"], "'./data.txt' is not an executable"),
    ],
)
def test_check_command(tmp_path: Path, command: list[str], error: str | None) -> None:
    for name in ("worker.py", "mymod.py", "run.sh", "data.txt"):
        (tmp_path / name).write_text("#!/bin/sh\n")
    (tmp_path / "run.sh").chmod(0o755)
    if error is None:
        check_command(command, cwd=str(tmp_path))
    else:
        with pytest.raises(ConfigError, match=re.escape(error)):
            check_command(command, cwd=str(tmp_path))


def test_format_plan_shows_command_cores_gpus_log_and_changed_variables() -> None:
    base = {"HOME": "/h", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "4,5"}
    cpus = [frozenset({0, 1}), frozenset({2, 3})]
    workers = build_workers(2, [PY, "train.py", "--note", "a b"], [7000, 7001], base, cpus)
    config = '{"cluster":{"worker":["127.0.0.1:7000","127.0.0.1:7001"]},"task":{"type":' \
        '"worker","index":1}}'
    assert format_plan(workers, base, log_dir="logs").splitlines()[9:] == [
        "worker 1:",
        f"  command: {shlex.quote(PY)} train.py --note 'a b'",
        "  cores: 2-3",
        "  gpus: 5 (tfdist.init() keeps these of CUDA_VISIBLE_DEVICES=4,5)",
        f"  log: {Path('logs', 'rank-1.log')}",
        "  TFDIST_LAUNCHER=local",
        "  TFDIST_LOCAL_RANK=1",
        "  TFDIST_LOCAL_WORLD_SIZE=2",
        f"  TF_CONFIG='{config}'",
    ]
    horovod = build_horovod_workers(1, ["prog"], 29400, {**base, "TF_CONFIG": "{}"})
    lines = format_plan(horovod, {**base, "TF_CONFIG": "{}"}).splitlines()
    assert lines[:3] == ["worker 0:", "  command: prog", "  cores: not pinned"]
    assert "  HOROVOD_GLOO_RENDEZVOUS_PORT=29400" in lines and lines[-1] == "  unset TF_CONFIG"


@pytest.mark.parametrize(
    ("visible", "gpus"),
    [
        ("0,1,2,3", ["0,1 (", "2,3 ("]),  # An equal, contiguous share by rank.
        ("4,5", ["4 (", "5 ("]),  # Physical ids kept.
        ("0", ["0 (", "0 ("]),  # A single GPU is shared.
        ("", ["none (", "none ("]),
        (None, ["its share (local rank 0 of 2)", "its share (local rank 1 of 2)"]),
        ("0,1,2", ["tfdist.init() would fail: 3 GPUs"] * 2),
    ],
)
def test_format_plan_gpus_are_those_each_worker_keeps(visible: str | None, gpus: list[str]) -> None:
    base = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    text = format_plan(build_workers(2, ["prog"], [7000, 7001], base), base)
    shown = [line[len("  gpus: "):] for line in text.splitlines() if line.startswith("  gpus: ")]
    assert len(shown) == 2
    assert all(line.startswith(start) for line, start in zip(shown, gpus, strict=True)), shown


# -- Real workers ---------------------------------------------------------------------------


@multiprocess
def test_two_workers_see_their_rank_and_prefix_output(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import json, os
        task = json.loads(os.environ["TF_CONFIG"])["task"]
        print("rank", task["index"], "local", os.environ["TFDIST_LOCAL_RANK"],
              "of", os.environ["TFDIST_LOCAL_WORLD_SIZE"], os.environ["TFDIST_LAUNCHER"])
        """,
    )
    result = _tfdist("launch", "-n", "2", script, TF_CONFIG='{"inherited": true}')
    assert result.returncode == 0, result.stderr
    assert _lines(result.stdout, 0) == ["rank 0 local 0 of 2 local"]
    assert _lines(result.stdout, 1) == ["rank 1 local 1 of 2 local"]


@multiprocess
def test_script_flags_reach_the_script_unparsed(tmp_path: Path) -> None:
    script = _script(tmp_path, "import json, sys; print(json.dumps(sys.argv[1:]))")
    args = ["--epochs=3", "-n", "5", "--flagfile=x", "--no-pin", "--", "y"]
    result = _tfdist("launch", "-n", "2", "--no-prefix", script, *args)
    assert result.returncode == 0, result.stderr
    assert [json.loads(line) for line in result.stdout.splitlines()] == [args, args]


@multiprocess
def test_module_and_executable_forms(tmp_path: Path) -> None:
    (tmp_path / "mymod.py").write_text("import sys; print(__name__, sys.argv[1:])")
    result = _tfdist("launch", "-n", "2", "-m", "mymod", "-x", PYTHONPATH=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert _lines(result.stdout, 1) == ["__main__ ['-x']"]
    result = _tfdist("launch", "-n", "2", PY, "-c", "import os; print(os.environ['TF_CONFIG'])")
    assert result.returncode == 0, result.stderr
    assert json.loads(_lines(result.stdout, 1)[0])["task"]["index"] == 1


@multiprocess
def test_output_is_whole_lines_with_cr_and_bad_bytes_handled(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import os, sys
        rank = os.environ["TFDIST_LOCAL_RANK"]
        out = sys.stdout.buffer
        for _ in range(2000):
            out.write(f"w{rank}-".encode() + b"x" * 100 + b"\\n")
        out.write(b"1/3\\r2/3\\r3/3\\r\\nbad \\xff byte\\nno newline")
        """,
    )
    out = io.StringIO()
    assert launch(build_command(script), 2, out=out) == 0
    lines = out.getvalue().splitlines()
    bulk = [line for line in lines if "-x" in line]
    assert len(bulk) == 4000
    assert all(re.fullmatch(r"\[(\d)\] w\1-x{100}", line) for line in bulk)
    for rank in (0, 1):
        tail = [line for line in _lines(out.getvalue(), rank) if "-x" not in line]
        assert tail == ["1/3", "2/3", "3/3", "bad \ufffd byte", "no newline"]


@multiprocess
def test_failing_worker_stops_the_others_and_sets_exit_code(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid0"
    start = time.monotonic()
    result = _tfdist("launch", "-n", "2", _script(tmp_path, FAIL_SCRIPT), str(pidfile), "3")
    assert time.monotonic() - start < 10
    assert result.returncode == 3
    assert "tfdist launch: worker 1 exited with code 3; stopping the other workers" in result.stderr
    assert not _alive(int(pidfile.read_text()))


@multiprocess
def test_worker_ignoring_sigterm_is_killed_after_grace_period(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid0"
    script = _script(tmp_path, FAIL_SCRIPT)
    start = time.monotonic()
    args = ["--grace-period", "1", script, str(pidfile), "1", "--ignore-term"]
    result = _tfdist("launch", "-n", "2", *args)
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr
    assert 1.0 <= elapsed < 5, elapsed
    assert not _alive(int(pidfile.read_text()))


@multiprocess
def test_a_time_limit_gives_each_worker_its_end_and_stops_them_there(tmp_path: Path) -> None:
    # Each worker prints the end it was given and sleeps past it: the launch stops them at the
    # end, as Slurm stops a job at its time limit, and says so.
    script = _script(tmp_path, """
        import os, time
        print("end", float(os.environ["TFDIST_END_TIME"]) - time.time(), flush=True)
        time.sleep(60)
        """)
    start = time.monotonic()
    result = _tfdist("launch", "-n", "2", "--time-limit", "3s", "--grace-period", "1", script)
    elapsed = time.monotonic() - start
    assert result.returncode == 124, result.stderr
    assert "the time limit (--time-limit) is reached" in result.stderr
    for rank in (0, 1):
        left = float(_lines(result.stdout, rank)[0].split()[1])
        assert 0 < left <= 3, result.stdout
    assert 3 <= elapsed < 10, elapsed


@multiprocess
def test_worker_killed_by_signal_exits_128_plus_signum(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid0"
    out = io.StringIO()
    code = launch(build_command(_script(tmp_path, FAIL_SCRIPT), [str(pidfile), "kill"]), 2, out=out)
    assert code == 128 + signal.SIGKILL
    assert not _alive(int(pidfile.read_text()))


@multiprocess
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_launcher_signal_stops_all_workers(tmp_path: Path, sig: signal.Signals, code: int) -> None:
    script = _script(tmp_path, SLEEP_SCRIPT)
    # Restore the default SIGINT handler: a shell may start background jobs with SIGINT ignored.
    boot = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    boot += "import sys; from tfdist.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = [PY, "-c", boot, "launch", "-n", "2", script, str(tmp_path)]
    launcher = subprocess.Popen(
        argv, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    pids = [_wait_for(tmp_path / f"pid{rank}") for rank in (0, 1)]
    launcher.send_signal(sig)
    _, stderr = launcher.communicate(timeout=10)
    assert launcher.returncode == code
    assert b"stopping the workers" in stderr
    assert not any(_alive(pid) for pid in pids)


@multiprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's parent-death signal")
def test_a_launcher_killed_outright_takes_its_workers_with_it(tmp_path: Path) -> None:
    # SIGKILL (the out-of-memory killer, kill -9): no handler of the launcher runs, and each
    # worker is in a session of its own; before, they trained on, orphaned.
    script = _script(tmp_path, SLEEP_SCRIPT)
    launcher = subprocess.Popen([PY, "-m", "tfdist", "launch", "-n", "2", script, str(tmp_path)],
                                cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    pids = [_wait_for(tmp_path / f"pid{rank}") for rank in (0, 1)]
    launcher.kill()
    launcher.wait(timeout=10)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids)


AFFINITY = "import os; print(sorted(os.sched_getaffinity(0)))"


@multiprocess
@needs_two_cores
def test_each_worker_is_pinned_to_its_own_core() -> None:
    result = _tfdist("launch", "-n", "2", PY, "-c", AFFINITY)
    assert result.returncode == 0, result.stderr
    cpus = [json.loads(_lines(result.stdout, rank)[0]) for rank in (0, 1)]
    assert cpus == [[CORES[0]], [CORES[1]]]


@multiprocess
@needs_two_cores
def test_cpus_per_worker_and_no_pin() -> None:
    result = _tfdist("launch", "-n", "1", "--cpus-per-worker", "2", PY, "-c", AFFINITY)
    assert result.returncode == 0, result.stderr
    assert json.loads(_lines(result.stdout, 0)[0]) == CORES[:2]
    result = _tfdist("launch", "-n", "2", "--no-pin", PY, "-c", AFFINITY)
    assert [json.loads(_lines(result.stdout, r)[0]) for r in (0, 1)] == [CORES, CORES]


@multiprocess
def test_more_workers_than_cores_share_cores_with_a_warning() -> None:
    n = len(CORES) + 1
    result = _tfdist("launch", "-n", str(n), PY, "-c", AFFINITY)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("workers share cores") == 1
    assert json.loads(_lines(result.stdout, n - 1)[0]) == [CORES[0]]


# Rank 0 prints two lines, then sleeps until stopped; rank 1 waits for them, writes to stdout
# and stderr, a byte that is not UTF-8 and an unfinished line, and exits 3.
LOG_SCRIPT = """
import os, pathlib, sys, time
rank = os.environ["TFDIST_LOCAL_RANK"]
ready = pathlib.Path(sys.argv[1], "ready")
print(f"rank {rank} starts")
if rank == "0":
    print("rank 0 line 2", flush=True)
    ready.write_text("")
    time.sleep(60)
deadline = time.monotonic() + 10
while not ready.exists() and time.monotonic() < deadline:
    time.sleep(0.02)
print("rank 1 fails", file=sys.stderr, flush=True)
sys.stdout.buffer.write(b"bad \\xff byte\\nno newline")
sys.exit(3)
"""


@multiprocess
def test_log_dir_gets_each_rank_complete_including_the_failing_worker(tmp_path: Path) -> None:
    logs = tmp_path / "new" / "logs"  # Created, parents too.
    result = _tfdist("launch", "-n", "2", "--log-dir", str(logs), _script(tmp_path, LOG_SCRIPT),
                     str(tmp_path))
    assert result.returncode == 3, result.stderr
    assert sorted(path.name for path in logs.iterdir()) == ["rank-0.log", "rank-1.log"]
    assert (logs / "rank-0.log").read_bytes() == b"rank 0 starts\nrank 0 line 2\n"
    assert (logs / "rank-1.log").read_bytes() == (
        b"rank 1 starts\nrank 1 fails\nbad \xff byte\nno newline\n"  # Unprefixed, undecoded.
    )
    assert _lines(result.stdout, 0) == ["rank 0 starts", "rank 0 line 2"]  # The terminal too.
    assert _lines(result.stdout, 1) == ["rank 1 starts", "rank 1 fails", "bad \ufffd byte",
                                        "no newline"]


@multiprocess
def test_log_dir_is_complete_when_the_launch_is_interrupted(tmp_path: Path) -> None:
    script = _script(tmp_path, "import os; print('started', os.environ['TFDIST_LOCAL_RANK'])\n"
                     + SLEEP_SCRIPT)
    boot = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    boot += "import sys; from tfdist.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = [PY, "-c", boot, "launch", "-n", "2", "--log-dir", str(tmp_path / "logs"), script,
            str(tmp_path)]
    launcher = subprocess.Popen(
        argv, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    pids = [_wait_for(tmp_path / f"pid{rank}") for rank in (0, 1)]
    launcher.send_signal(signal.SIGINT)
    launcher.communicate(timeout=10)
    assert launcher.returncode == 130
    assert not any(_alive(pid) for pid in pids)
    for rank in (0, 1):
        assert (tmp_path / "logs" / f"rank-{rank}.log").read_text() == f"started {rank}\n"


@multiprocess
def test_log_dir_is_emptied_at_start_and_keeps_every_restart(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank-0.log").write_text("an earlier launch\n")
    script = _script(tmp_path, "import os; print('run', os.environ['TFDIST_RESTART_COUNT']); "
                     "raise SystemExit(75)")  # Preempted: the launcher waits for both.
    result = _tfdist("launch", "-n", "2", "--max-restarts", "1", "--log-dir", str(logs), script)
    assert result.returncode == 75, result.stderr
    assert [(logs / f"rank-{r}.log").read_text() for r in (0, 1)] == ["run 0\nrun 1\n"] * 2


# -- Command line ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-n", "2", "--port-base", "80", "x"], "tfdist: --port-base 80 does not fit 2 workers"),
        (["-n", "1", "--cpus-per-worker", "99", "x"], "lower --cpus-per-worker or -n"),
        (["-n", "1", "--cpus-per-worker", "1", "--no-pin", "x"], "do not combine it with"),
        (["-n", "1", "--grace-period", "-1", "x"], "--grace-period must be >= 0"),
        (["-n", "1", "no-such-program-tfdist"], "tfdist: 'no-such-program-tfdist' is not an exe"),
        # A missing target is refused before anything starts, also in a dry run.
        (["-n", "2", "--dry-run", "missing.py"], "tfdist: script 'missing.py' not found"),
        (["-n", "2", "--dry-run", "-m", "no_such_module_tfdist"], "module 'no_such_module_tfdist'"),
    ],
)
def test_launch_errors_print_the_fix_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["launch", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["launch", "-n", "0", "x"], "must be at least 1, got 0"),
        (["launch", "x"], "-n/--num-workers"),
        (["launch", "-n", "2"], "SCRIPT"),
        (["launch", "--nproc-per-node", "gpu", "x"], "expected a whole number, got 'gpu'"),
        # No torch backend: tfdist.torch meets at rank 0's TF_CONFIG address (the default).
        (["launch", "-n", "1", "--backend", "torch", "x"], "invalid choice: 'torch'"),
        (["launch", "-n", "1", "--time-limit", "soon", "x"], "write 90s, 10min, 2h, 1d"),
        ([], "COMMAND"),
    ],
)
def test_bad_flags_exit_2_with_usage(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["-n", "2"], {"num_workers": 2}),
        (["--num-workers", "3"], {"num_workers": 3}),
        (["--nproc-per-node", "4"], {"num_workers": 4}),  # torchrun's spellings of -n.
        (["--nproc_per_node=5"], {"num_workers": 5}),
        (["-n", "1", "--max_restarts", "2"], {"max_restarts": 2}),
        (["-n", "1", "--max-restarts=3"], {"max_restarts": 3}),
        (["-n", "1", "--time-limit", "90s"], {"time_limit": 90.0}),
        (["-n", "1", "--time-limit", "2"], {"time_limit": 120.0}),  # minutes, as sbatch --time
        (["-n", "1", "--time-limit", "1:00:00"], {"time_limit": 3600.0}),
        (["-n", "1", "--module"], {"module": True}),
        (["-n", "1", "-m"], {"module": True}),
        (["-n", "1", "--log-dir", "logs", "--dry-run"], {"log_dir": "logs", "dry_run": True}),
        (["-n", "1"], {"log_dir": None, "dry_run": False, "module": False, "max_restarts": 0}),
    ],
)
def test_launch_flags_and_torchrun_spellings(argv: list[str], expected: dict[str, object]) -> None:
    args = build_parser().parse_args(["launch", *argv, "train.py", "--nproc-per-node", "9"])
    assert {name: getattr(args, name) for name in expected} == expected
    assert (args.script, args.args) == ("train.py", ["--nproc-per-node", "9"])  # The script's.


def test_help_explains_the_gpu_split_with_a_true_example(
    capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["launch", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    example = ("CUDA_VISIBLE_DEVICES=0,1,2,3 and -n 2: worker 0 gets GPUs 0,1, "
               "worker 1 gets GPUs 2,3.")
    assert example in text
    found = re.search(r"CUDA_VISIBLE_DEVICES=(\S+) and -n (\d+): worker 0 gets GPUs (\S+), "
                      r"worker 1 gets GPUs (\S+)\.", text)
    assert found is not None
    visible, n, *gpus = found.groups()
    # What each worker's tfdist.init() keeps (tfdist.devices), with the same inputs.
    assert [select_gpus(visible, rank, int(n), False) for rank in (0, 1)] == [
        gpus[0].rstrip(","), gpus[1]]
    assert "A single id (CUDA_VISIBLE_DEVICES=0) is shared by all workers" in text
    assert [select_gpus("0", rank, 2, False) for rank in (0, 1)] == ["0", "0"]
    assert "unset each worker takes the same share of the GPUs the framework counts" in text
    assert select_gpus(None, 1, 2, False) is None and share(4, 1, 2) == range(2, 4)
    assert "A GPU count that N does not divide is an error" in text
    with pytest.raises(ConfigError):
        select_gpus("0,1,2", 0, 2, False)
    with pytest.raises(ConfigError):
        share(3, 0, 2)


def _parse_plan(text: str) -> dict[int, dict[str, Any]]:
    """``--dry-run``'s output as ``{rank: {"command": ..., "cores": ..., "env": {NAME: value,
    or None when unset}}}``."""
    workers: dict[int, dict[str, Any]] = {}
    current: dict[str, Any] = {}
    for line in text.splitlines():
        if found := re.fullmatch(r"worker (\d+):", line):
            current = workers[int(found[1])] = {"env": {}}
        elif found := re.fullmatch(r"  unset (\w+)", line):
            current["env"][found[1]] = None
        elif found := re.fullmatch(r"  ([A-Z_][A-Z0-9_]*)=(.*)", line):
            (current["env"][found[1]],) = shlex.split(found[2])  # One shell word each.
        elif found := re.fullmatch(r"  (\w+): (.*)", line):
            current[found[1]] = found[2]
    return workers


def _worker_environ(changes: dict[str, str | None]) -> dict[str, str]:
    """This environment with a printed worker's changes applied."""
    environ = {**os.environ, **{name: v for name, v in changes.items() if v is not None}}
    return {name: v for name, v in environ.items() if changes.get(name, "") is not None}


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting a worker or Horovod's rendezvous server fails the test."""

    def refuse(*args: object, **kwargs: object) -> NoReturn:
        raise AssertionError(f"--dry-run started something: {args}")

    monkeypatch.setattr(tfdist.supervisor.subprocess, "Popen", refuse)
    monkeypatch.setattr("tfdist.horovod.rendezvous.RendezvousServer", refuse)
    monkeypatch.setattr("tfdist.horovod.install.is_installed", lambda: True)


@pytest.mark.usefixtures("nothing_starts")
@pytest.mark.parametrize("backend", ["mwms", "horovod"])
def test_dry_run_prints_each_worker_and_starts_nothing(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.setenv("TF_CONFIG", '{"inherited": true}')
    monkeypatch.delenv("TFDIST_RESTART_COUNT", raising=False)
    script, logs = _script(tmp_path, "raise SystemExit('started')"), tmp_path / "logs"
    argv = ["launch", "--dry-run", "--backend", backend, "--nproc-per-node", "2", "--log-dir",
            str(logs), script, "--epochs=3"]
    assert main(argv) == 0
    workers = _parse_plan(capsys.readouterr().out)
    assert sorted(workers) == [0, 1]
    for rank, worker in workers.items():
        assert worker["command"] == shlex.join([PY, script, "--epochs=3"])
        assert worker["cores"] == str(CORES[rank % len(CORES)])
        assert worker["gpus"].startswith(["0,1 ", "2,3 "][rank])  # The --help example.
        assert worker["log"] == str(logs / f"rank-{rank}.log")
        env = worker["env"]
        assert env["TFDIST_LOCAL_RANK"] == str(rank) and env["TFDIST_RESTART_COUNT"] == "0"
        assert "CUDA_VISIBLE_DEVICES" not in env and "PATH" not in env  # Only what changes.
        if backend == "mwms":
            config = json.loads(env["TF_CONFIG"])
            assert config["task"] == {"type": "worker", "index": rank}
            assert len(config["cluster"]["worker"]) == 2
            assert config == {**json.loads(workers[0]["env"]["TF_CONFIG"]), "task": config["task"]}
        else:
            assert env["TF_CONFIG"] is None  # The inherited one is removed.
            assert (env["HOROVOD_RANK"], env["TFDIST_BACKEND"]) == (str(rank), "horovod")
        # The printed changes are all a worker needs: it detects its place from them.
        found = detect(_worker_environ(env))
        assert (found.rank, found.world_size, found.local_rank) == (rank, 2, rank)
    assert not logs.exists()


@pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                    reason="torch is not installed (requirements/torch.txt)")
@pytest.mark.usefixtures("nothing_starts")
def test_dry_run_gives_a_torch_script_its_rendezvous(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tfdist.torch.rendezvous import plan  # Imports torch.

    # tfdist.torch needs no backend of its own: it meets at rank 0's TF_CONFIG address.
    assert main(["launch", "--dry-run", "-n", "2", "--port-base", "29400",
                 _script(tmp_path, "import torch")]) == 0
    for rank, worker in _parse_plan(capsys.readouterr().out).items():
        rendezvous = plan(detect(_worker_environ(worker["env"])))
        assert (rendezvous.init_method, rendezvous.rank, rendezvous.world_size) == (
            "tcp://127.0.0.1:29400", rank, 2)


@pytest.mark.usefixtures("nothing_starts")
def test_gpus_per_worker_gives_each_worker_its_own_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # 8 GPUs, 2 workers x 2: the workers get the first 4 and each keeps its own 2.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    assert main(["launch", "--dry-run", "-n", "2", "--gpus-per-worker", "2",
                 _script(tmp_path, "pass")]) == 0
    workers = _parse_plan(capsys.readouterr().out)
    for rank, worker in workers.items():
        assert worker["env"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
        assert worker["gpus"].startswith(["0,1 ", "2,3 "][rank])
        found = detect(_worker_environ(worker["env"]))
        assert select_gpus(found.visible_devices, found.local_rank, found.local_world_size,
                           found.gpus_per_task is not None) == ["0,1", "2,3"][rank]


@pytest.mark.usefixtures("nothing_starts")
@pytest.mark.parametrize(("argv", "visible", "message"), [
    (["-n", "3", "--gpus-per-worker", "2"], "0,1,2,3",
     "-n 3 --gpus-per-worker 2 needs 6 GPUs, but 4 are visible"),
    (["-n", "2", "--gpus-per-worker", "2", "--backend", "horovod"], "0,1,2,3",
     "Horovod drives one GPU per process"),
    (["-n", "2", "--gpus-per-worker", "1"], "", "this machine shows no GPU"),
])
def test_gpus_per_worker_refuses_what_cannot_be(
    argv: list[str], visible: str, message: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert main(["launch", "--dry-run", *argv, _script(tmp_path, "pass")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tfdist: ") and message in err, err


def test_dry_run_in_a_real_launcher_runs_no_worker(tmp_path: Path) -> None:
    marker, logs = tmp_path / "ran", tmp_path / "logs"
    script = _script(tmp_path, "import pathlib, sys; pathlib.Path(sys.argv[1]).write_text('')")
    result = _tfdist("launch", "-n", "2", "--dry-run", "--log-dir", str(logs), script, str(marker))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("tfdist launch --dry-run: 2 worker(s), --backend mwms; ")
    assert sorted(_parse_plan(result.stdout)) == [0, 1]
    time.sleep(0.5)  # A worker, had one started, would have written by now.
    assert not marker.exists() and not logs.exists()


@pytest.mark.usefixtures("nothing_starts")
def test_log_dir_that_cannot_be_created_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    argv = ["launch", "-n", "1", "--log-dir", str(tmp_path / "file" / "logs"), PY, "-c", "pass"]
    assert main(argv) == 2
    assert "cannot write the workers' logs there" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert re.fullmatch(r"tfdist \S+\n", capsys.readouterr().out)


TWO_WORKERS = '{"cluster":{"worker":["a:1","b:2"]},"task":{"type":"worker","index":1}}'


def test_env_prints_the_detected_environment() -> None:
    from dataclasses import asdict

    from tfdist.doctor.probe import versions
    from tfdist.env import detect

    fields = asdict(detect({"TF_CONFIG": TWO_WORKERS}))
    # The plan: two processes from TF_CONFIG are MWMS workers; no GPU information here, so the
    # node's GPU device files decide (NCCL and a replica per GPU where it has some); the rest
    # as tfdist doctor's table shows it.
    gpus = node_gpus()
    fields.update(backend="mwms", backend_reason=f"auto: 2 processes ({fields['reason']})",
                  collective="nccl" if gpus else "ring", gpus="counted by the framework",
                  replicas=gpus // fields["local_world_size"] or 1,
                  cpus=ranges(os.sched_getaffinity(0)), host=socket.gethostname(),
                  versions=versions())
    # Only TF_CONFIG: a Slurm or MPI variable in the test's own environment would win.
    environ = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO)}
    environ["TF_CONFIG"] = TWO_WORKERS
    results = [_run([PY, "-m", "tfdist", "env", *flags], environ) for flags in ([], ["--json"])]
    # TF_CONFIG's hosts a and b do not resolve: an error, so the exit status is 1
    assert [r.returncode for r in results] == [1, 1], results[0].stderr
    lines = results[0].stdout.splitlines()
    assert lines[:len(fields)] == [f"{name}: {value}" for name, value in fields.items()]
    # then the patches of this launch (tests/test_patches.py checks which), as many in both
    shown = json.loads(results[1].stdout)
    assert lines[len(fields)] == (f"patches: {len(shown.pop('patches'))} change(s) to library "
                                  "internals here (tfdist/patches.py)"), lines
    # What tfdist doctor would say of this rank alone: TF_CONFIG's host "a" does not resolve.
    problems = shown.pop("problems")
    assert len(problems) == 1 and "cannot resolve a " in problems[0], problems
    assert results[0].stderr == f"tfdist env: {problems[0]}\n"
    assert shown == json.loads(json.dumps(fields, default=str))
    assert "tensorflow" in fields["versions"] and fields["cpus"]
    assert fields["rank"] == 1


@pytest.mark.parametrize(("variable", "value", "message"), [
    ("TF_CONFIG", "not json", "TF_CONFIG"),
    ("TFDIST_BACKEND", "mwm", "backend 'mwm' is not one of"),  # every setting is checked
    ("TFDIST_PREEMPT_CHECK_SECONDS", "soon", "TFDIST_PREEMPT_CHECK_SECONDS"),
])
def test_env_error_prints_message_and_exits_2(variable: str, value: str, message: str) -> None:
    result = _tfdist("env", **{variable: value})
    assert result.returncode == 2
    assert result.stderr.startswith("tfdist: ") and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@multiprocess
def test_workers_launched_by_tfdist_detect_their_rank() -> None:
    result = _tfdist("launch", "-n", "2", "-m", "tfdist", "env")
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        lines = _lines(result.stdout, rank)
        expected = {"launcher: local", f"rank: {rank}", "world_size: 2", f"local_rank: {rank}"}
        assert expected <= set(lines)


def test_cli_imports_no_heavy_framework() -> None:
    code = "import sys, tfdist.cli, tfdist.launch; "
    code += "print([m for m in ('tensorflow', 'keras', 'horovod') if m in sys.modules])"
    result = _run([PY, "-c", code], _env())
    assert result.stdout.strip() == "[]", result.stderr


PREEMPTED_SCRIPT = """
import os, pathlib, sys, time
rank = int(os.environ["TFDIST_LOCAL_RANK"])
time.sleep(1.0 * rank)  # rank 1 saves its state for a second longer
pathlib.Path(sys.argv[1], f"saved{rank}").write_text(os.environ["TFDIST_RESTART_COUNT"])
sys.exit(75)
"""


@multiprocess
def test_preempted_workers_are_waited_for_not_stopped(tmp_path: Path) -> None:
    out = io.StringIO()
    code = launch(build_command(_script(tmp_path, PREEMPTED_SCRIPT), [str(tmp_path)]), 2, out=out)
    assert code == 75
    # Rank 1 exited 75 a second after rank 0 and was not stopped before it had saved.
    assert [(tmp_path / f"saved{rank}").read_text() for rank in (0, 1)] == ["0", "0"]


@multiprocess
def test_max_restarts_runs_the_workers_again_with_the_restart_count(tmp_path: Path) -> None:
    result = _tfdist("launch", "--max-restarts", "2", "-n", "2",
                     _script(tmp_path, PREEMPTED_SCRIPT), str(tmp_path))
    assert result.returncode == 75, result.stderr
    assert [(tmp_path / f"saved{rank}").read_text() for rank in (0, 1)] == ["2", "2"]
    assert result.stderr.count("restarting all workers") == 2
    assert "giving up after 2 restart(s)" in result.stderr


def test_max_restarts_must_not_be_negative() -> None:
    with pytest.raises(ConfigError, match="--max-restarts must be >= 0"):
        launch(["true"], 1, max_restarts=-1)
