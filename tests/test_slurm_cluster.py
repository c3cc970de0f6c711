"""The Slurm test cluster itself (tests/slurm) and its container stand-ins.

What the other Slurm tests rely on: three nodes with their own hostnames and addresses in
Slurm's order (n9 before n10, unlike string order), the task variables and fake GPUs Slurm
gives, pmix, tfdist's detection under srun and in the batch shell, and the pyxis and apptainer
stand-ins checking their arguments the way the real tools do.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from slurmtest import SlurmCluster

from tfdist.hostlist import expand_hostlist

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_SH = ROOT / "tests" / "slurm" / "cluster.sh"
APPTAINER = ROOT / "tests" / "slurm" / "standins" / "apptainer"

# Other pytest sessions may share the cluster: name the nodes whose names the tests check.
TWO_NODES = ("-N2", "--nodelist=n[9-10]")
# Prints one line per task: hostname and the variables a launcher reads.
TASK_LINE = ('echo "$(hostname) $SLURM_PROCID $SLURM_LOCALID $SLURM_NODEID '
             '${CUDA_VISIBLE_DEVICES:-none} $SLURM_STEP_NODELIST"')


def task_lines(out: subprocess.CompletedProcess[str]) -> dict[int, list[str]]:
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()]
    return {int(row[1]): [row[0], *row[2:]] for row in rows}


@pytest.mark.timeout(30)
def test_check_says_why_the_cluster_cannot_run() -> None:
    # The reason the Slurm tests skip with: here no Slurm or munge binaries on PATH.
    out = subprocess.run(["bash", str(CLUSTER_SH), "check"], env={"PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 3
    if os.geteuid() == 0:
        assert out.stdout.startswith("missing slurmctld slurmd munged mungekey")
        assert "the Debian packages slurm-wlm munge" in out.stdout and "make system" in out.stdout
    else:
        assert "needs root" in out.stdout


@pytest.mark.timeout(60)
def test_start_is_idempotent_and_nodes_are_idle(slurm_cluster: SlurmCluster) -> None:
    started = time.monotonic()
    again = subprocess.run(["bash", str(CLUSTER_SH), "start"],
                           env=slurm_cluster.env, capture_output=True, text=True, timeout=60,
                           check=False)
    assert again.returncode == 0 and "already running" in again.stderr, again.stderr
    assert time.monotonic() - started < 5
    sinfo = slurm_cluster.run("sinfo", "-h", "-N", "-p", slurm_cluster.partition, "-o",
                              "%N %c %G %t")
    rows = [line.split() for line in sinfo.stdout.splitlines()]
    assert [row[0] for row in rows] == ["n9", "n10", "n11"] == list(slurm_cluster.nodes)
    for _, cpus, gres, state in rows:  # other sessions' jobs may be running
        assert (cpus, gres) == ("4", "gpu:fake:2") and state in ("idle", "mix", "alloc"), rows


@pytest.mark.timeout(60)
def test_tasks_see_own_hostname_ranks_and_node_gpus(slurm_cluster: SlurmCluster) -> None:
    out = slurm_cluster.srun(*TWO_NODES, "--ntasks-per-node=2", "--gpus-per-node=2",
                             "bash", "-c", TASK_LINE)
    assert task_lines(out) == {
        0: ["n9", "0", "0", "0,1", "n[9-10]"],
        1: ["n9", "1", "0", "0,1", "n[9-10]"],
        2: ["n10", "0", "1", "0,1", "n[9-10]"],
        3: ["n10", "1", "1", "0,1", "n[9-10]"],
    }


@pytest.mark.timeout(60)
def test_gpus_per_task_binds_one_gpu_to_each_task(slurm_cluster: SlurmCluster) -> None:
    out = slurm_cluster.srun(*TWO_NODES, "--ntasks-per-node=2", "--gpus-per-task=1",
                             "bash", "-c", TASK_LINE)
    lines = task_lines(out)
    for node in ("n9", "n10"):
        gpus = sorted(row[3] for row in lines.values() if row[0] == node)
        assert gpus == ["0", "1"], lines


@pytest.mark.timeout(60)
def test_gpu_type_is_requestable_and_limits_are_enforced(slurm_cluster: SlurmCluster) -> None:
    typed = slurm_cluster.srun("-N1", f"--gpus={slurm_cluster.gres_type}:2", "bash", "-c",
                               'echo "$CUDA_VISIBLE_DEVICES $SLURM_GPUS_ON_NODE"')
    assert typed.returncode == 0 and typed.stdout.split() == ["0,1", "2"], typed.stderr
    too_many = slurm_cluster.srun("-N1", "--gpus-per-node=3", "true", timeout=30)
    assert too_many.returncode != 0
    assert "Requested node configuration is not available" in too_many.stderr


@pytest.mark.timeout(60)
def test_srun_mpi_pmix_starts_pmix_tasks(slurm_cluster: SlurmCluster) -> None:
    out = slurm_cluster.srun("--mpi=pmix", *TWO_NODES, "-n2", "bash", "-c",
                             'echo "$(hostname) $PMIX_RANK $SLURM_PROCID"')
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.split("\n")[:-1]) == ["n10 1 1", "n9 0 0"]


@pytest.mark.timeout(60)
def test_nodes_reach_each_other_by_name_over_tcp(slurm_cluster: SlurmCluster) -> None:
    # Rank 1 listens on n10; rank 0 on n9 dials "n10" through the node's private hosts file.
    script = (
        "import os, socket, time\n"
        "if os.environ['SLURM_PROCID'] == '1':\n"
        "    s = socket.create_server(('', 23456)); c, peer = s.accept()\n"
        "    print('n10 got', c.recv(16).decode(), 'from', peer[0])\n"
        "else:\n"
        "    for _ in range(100):\n"
        "        try: c = socket.create_connection(('n10', 23456), timeout=5); break\n"
        "        except OSError: time.sleep(0.1)\n"
        "    c.sendall(socket.gethostname().encode()); c.close()\n"
    )
    out = slurm_cluster.srun(*TWO_NODES, "-n2", slurm_cluster.python, "-c", script)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"n10 got n9 from {slurm_cluster.addresses['n9']}"
    hosts = slurm_cluster.srun("-N1", "-w", "n11", "cat", "/etc/hosts").stdout
    assert f"{slurm_cluster.addresses['n10']} n10" in hosts
    assert "n10" not in Path("/etc/hosts").read_text()  # the machine's own file is untouched


@pytest.mark.timeout(90)
def test_tfdist_env_under_srun_lists_hosts_in_slurm_order(slurm_cluster: SlurmCluster) -> None:
    job = slurm_cluster.run_job(f"""
        #SBATCH --nodes=2 --nodelist=n[9-10] --ntasks-per-node=2
        srun --output=env-%t.json {slurm_cluster.python} -m tfdist env --json
    """)
    assert job.ok, job.describe()
    envs = [json.loads(job.read(f"env-{rank}.json")) for rank in range(4)]
    addresses = envs[0]["worker_addresses"]
    assert [h.split(":")[0] for h in addresses] == ["n9", "n9", "n10", "n10"]
    for rank, env in enumerate(envs):
        assert env["launcher"] == "slurm" and env["job_id"] == job.job_id
        assert (env["rank"], env["world_size"], env["local_rank"], env["node_rank"]) == (
            rank, 4, rank % 2, rank // 2)
        assert env["hosts"] == ["n9", "n10"]
        assert env["worker_addresses"] == addresses


@pytest.mark.timeout(60)
def test_tfdist_in_batch_shell_of_multitask_job_fails_fast(slurm_cluster: SlurmCluster) -> None:
    job = slurm_cluster.run_job(f"""
        #SBATCH --nodes=2 --ntasks-per-node=2
        exec {slurm_cluster.python} -m tfdist env
    """)
    assert (job.state, job.exit_code) == ("FAILED", 2), job.describe()
    assert "tfdist: " in job.output and "srun" in job.output, job.output
    assert "Traceback" not in job.output
    assert job.seconds < 20


# --- pyxis stand-in -----------------------------------------------------------------------------

@pytest.fixture
def pyxis(slurm_cluster: SlurmCluster) -> SlurmCluster:
    if not slurm_cluster.pyxis_standin:
        pytest.skip("the pyxis stand-in is not built: no C compiler or no slurm/spank.h "
                    "(Debian: gcc, libslurm-dev)")
    return slurm_cluster


def pyxis_env(out: subprocess.CompletedProcess[str]) -> list[str]:
    return sorted(line for line in out.stdout.splitlines() if line.startswith("PYXIS_STANDIN_"))


@pytest.mark.timeout(60)
def test_pyxis_options_reach_srun_tasks(pyxis: SlurmCluster) -> None:
    out = pyxis.srun(*TWO_NODES, "--ntasks-per-node=1", "--container-image=nvcr.io#nvidia/tf:24.01",
                     "--container-mounts=/work:/work:ro+rprivate,/tmp", "--container-workdir=/w",
                     "--no-container-mount-home", "--container-writable", "--container-env=A,B",
                     "--container-name=tf:exec", "printenv")
    assert out.returncode == 0, out.stderr
    expected = ["PYXIS_STANDIN_CONTAINER_ENV=A,B",
                "PYXIS_STANDIN_CONTAINER_IMAGE=nvcr.io#nvidia/tf:24.01",
                "PYXIS_STANDIN_CONTAINER_MOUNTS=/work:/work:ro+rprivate,/tmp",
                "PYXIS_STANDIN_CONTAINER_MOUNT_HOME=0",
                "PYXIS_STANDIN_CONTAINER_NAME=tf:exec",
                "PYXIS_STANDIN_CONTAINER_WORKDIR=/w",
                "PYXIS_STANDIN_CONTAINER_WRITABLE=1"]
    assert pyxis_env(out) == sorted(expected * 2)


@pytest.mark.timeout(60)
def test_pyxis_sbatch_options_reach_batch_shell_and_steps(pyxis: SlurmCluster) -> None:
    job = pyxis.run_job("""
        #SBATCH --nodes=2 --nodelist=n[9-10] --ntasks-per-node=1
        #SBATCH --container-image=/etc/hostname --container-mounts=/tmp:/tmp
        prefix=PYXIS_STANDIN_CONTAINER_
        echo "batch $(printenv ${prefix}IMAGE) $(printenv ${prefix}MOUNTS)"
        srun --container-workdir=/w bash -c \\
            "echo step \\$(hostname) \\$(printenv ${prefix}IMAGE) \\$(printenv ${prefix}WORKDIR)"
    """)
    assert job.ok, job.describe()
    lines = sorted(" ".join(line.split()) for line in job.output.splitlines())
    assert lines == ["batch /etc/hostname /tmp:/tmp", "step n10 /etc/hostname /w",
                     "step n9 /etc/hostname /w"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("option", "message"), [
    ("--container-mounts=/work:work", "the target must be a relative or absolute path"),
    ("--container-mounts=/a:/b:c:d", "invalid format, expected SRC:DST[:FLAGS]"),
    ("--container-mounts=/tmp:/tmp:ro,rprivate", "the source must be a relative or absolute"),
    ("--container-mounts=/tmp:/tmp:ro+nosuchflag", 'unknown mount flag "nosuchflag"'),
    ("--container-name=tf:sometimes", "must be auto, create, exec or no_exec"),
    ("--container-env=A,1B", '"1B" is not a variable name'),
])
def test_pyxis_rejects_bad_values_at_submission(pyxis: SlurmCluster, option: str,
                                                message: str) -> None:
    out = pyxis.srun("-N1", option, "true", timeout=30)
    assert out.returncode != 0
    assert f"pyxis stand-in: {option.split('=')[0]}" in out.stderr and message in out.stderr
    with pytest.raises(RuntimeError, match="pyxis stand-in"):
        pyxis.sbatch("true", option)


@pytest.mark.timeout(60)
def test_pyxis_fails_the_task_when_a_source_is_missing_on_the_node(pyxis: SlurmCluster) -> None:
    out = pyxis.srun("-N1", "--container-mounts=/no/such/dir:/data", "true")
    assert out.returncode == 1
    assert "source /no/such/dir does not exist on this node" in out.stderr
    conflict = pyxis.srun("-N1", "--container-writable", "--container-readonly", "true")
    assert conflict.returncode != 0
    assert "both --container-writable and --container-readonly" in conflict.stderr


# --- apptainer stand-in -------------------------------------------------------------------------

def apptainer(*args: str, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(APPTAINER), *args], capture_output=True, text=True, timeout=30,
                          env={**os.environ, **(env or {})}, cwd=cwd, check=False)


@pytest.fixture
def image(tmp_path: Path) -> Path:
    path = tmp_path / "tf.sif"
    path.write_bytes(b"not a real image: the apptainer stand-in only checks that it exists")
    return path


@pytest.mark.timeout(30)
def test_apptainer_announces_itself_as_a_stand_in() -> None:
    out = apptainer("--version")
    assert out.returncode == 0 and "stand-in" in out.stdout and "no container" in out.stdout


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("args", "message"), [
    (["exec", "--gpus", "IMAGE", "true"], "unknown flag: --gpus"),
    (["shell", "IMAGE"], 'unknown command "shell"'),
    (["exec", "/no/such.sif", "true"], "could not open image /no/such.sif"),
    (["exec", "docker://tensorflow/tensorflow", "true"], "cannot pull docker://"),
    (["exec", "-B", "/no/such/dir:/data", "IMAGE", "true"], "mount source /no/such/dir"),
    (["exec", "--bind=/tmp:data", "IMAGE", "true"], "must be an absolute path"),
    (["exec", "-B", "/tmp:/tmp:rx", "IMAGE", "true"], "must be ro or rw"),
    (["exec", "--env", "1A=2", "IMAGE", "true"], "use NAME=VALUE"),
    (["exec", "-B"], "flag needs an argument: -B"),
    (["run", "IMAGE"], "needs a COMMAND"),
])
def test_apptainer_rejects_bad_arguments(image: Path, args: list[str], message: str) -> None:
    out = apptainer(*[str(image) if a == "IMAGE" else a for a in args])
    assert out.returncode == 255
    assert message in out.stderr


@pytest.mark.timeout(30)
def test_apptainer_runs_the_command_on_the_host(image: Path, tmp_path: Path) -> None:
    log = tmp_path / "apptainer.log"
    out = apptainer("exec", "--nv", "-B", f"{tmp_path}:{tmp_path}:ro,/tmp", "--env", "A=1,B=2",
                    "--cleanenv", "--pwd", str(tmp_path), str(image), "bash", "-c",
                    'echo "$A $B $PWD $APPTAINER_CONTAINER $APPTAINER_STANDIN ${HIDDEN:-unset}"',
                    env={"APPTAINER_STANDIN_LOG": str(log), "HIDDEN": "x"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "2", str(tmp_path), str(image), "1", "unset"]
    assert "apptainer stand-in: exec" in out.stderr and "no container" in out.stderr
    assert f"binds={tmp_path}:{tmp_path}:ro,/tmp" in log.read_text()


@pytest.mark.timeout(60)
def test_apptainer_in_a_job_runs_on_every_node(slurm_cluster: SlurmCluster, image: Path,
                                               tmp_path: Path) -> None:
    log = tmp_path / "apptainer.log"
    job = slurm_cluster.run_job(
        f"""
        #SBATCH --nodes=2 --nodelist=n[9-10] --ntasks-per-node=1
        srun apptainer exec --nv -B {ROOT}:{ROOT} {image} \\
            {slurm_cluster.python} -c 'import socket; print("task on", socket.gethostname())'
        """, env=slurm_cluster.job_env(APPTAINER_STANDIN_LOG=str(log)))
    assert job.ok, job.describe()
    assert sorted(line for line in job.output.splitlines() if line.startswith("task on")) == [
        "task on n10", "task on n9"]
    records = log.read_text().splitlines()
    assert sorted(r.split(" host=")[1].split()[0] for r in records) == ["n10", "n9"]


# scontrol needs no running cluster for this, only a configuration. (Slurm 22.05 reads
# "n2\nn[3-4]" as one prefix "n2\nn", a quirk tfdist does not copy: there it is n2 n3 n4.)
SCONTROL_HOSTLISTS = ["n[9-10]", "rack[1-2]-n[01-02]", "a[1-2]b[1-2]c[1-2]",
                      "a[1-3]b[1-2]c[1-2]d[1-2]", "x[098-101]", "n1 n2\tn3\nn4", "n[1-2] m[3-4]",
                      "a ,b", "n1, n[2-3],n1"]


@pytest.mark.timeout(60)
def test_hostlists_expand_as_scontrol_show_hostnames_does(slurm_cluster: SlurmCluster) -> None:
    for expression in SCONTROL_HOSTLISTS:
        shown = slurm_cluster.run("scontrol", "show", "hostnames", expression)
        assert shown.returncode == 0, shown.stderr
        assert expand_hostlist(expression) == shown.stdout.split(), expression
