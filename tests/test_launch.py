"""Tests of ``tfdist launch`` and the ``tfdist`` command line.

The pure builders are checked as tables; everything else runs real worker processes (small
Python scripts, no TensorFlow) through ``python -m tfdist`` or :func:`tfdist.launch.launch`.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tfdist.cli import main
from tfdist.doctor.report import ranges
from tfdist.errors import ConfigError
from tfdist.launch import (
    assign_cpus,
    build_command,
    build_workers,
    exit_code,
    free_ports,
    launch,
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


# -- Command line ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-n", "2", "--port-base", "80", "x"], "tfdist: --port-base 80 does not fit 2 workers"),
        (["-n", "1", "--cpus-per-worker", "99", "x"], "lower --cpus-per-worker or -n"),
        (["-n", "1", "--cpus-per-worker", "1", "--no-pin", "x"], "do not combine it with"),
        (["-n", "1", "--grace-period", "-1", "x"], "--grace-period must be >= 0"),
        (["-n", "1", "no-such-program-tfdist"], "tfdist: cannot start worker 0"),
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
    # The plan: two processes from TF_CONFIG are MWMS workers; no GPU information here; the
    # rest as tfdist doctor's table shows it.
    fields.update(backend="mwms", backend_reason=f"auto: 2 processes ({fields['reason']})",
                  collective="ring", gpus="counted by the framework",
                  cpus=ranges(os.sched_getaffinity(0)), host=socket.gethostname(),
                  versions=versions())
    # Only TF_CONFIG: a Slurm or MPI variable in the test's own environment would win.
    environ = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO)}
    environ["TF_CONFIG"] = TWO_WORKERS
    results = [_run([PY, "-m", "tfdist", "env", *flags], environ) for flags in ([], ["--json"])]
    assert [r.returncode for r in results] == [0, 0], results[0].stderr
    assert results[0].stdout.splitlines() == [f"{name}: {value}" for name, value in fields.items()]
    assert json.loads(results[1].stdout) == json.loads(json.dumps(fields, default=str))
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
