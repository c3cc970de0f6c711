"""The README's install recipes, run for real: the wheel, a site's TensorFlow module, the extras,
and what a container image needs.

One wheel is built from a copy of the checkout (module-scoped), and one venv is made the way
the module recipe makes it; the tests share both. Everything installs offline (``--no-index``,
no pip configuration): a test fails instead of downloading, so no test downloads TensorFlow,
a data set or model weights.

What this machine cannot run is said where it applies: a plain venv with the ``cpu``/``gpu``
extra (it would download TensorFlow) is checked through the wheel's metadata and a resolver
run against an installed tensorflow-cpu; the container runtimes (Apptainer, enroot) are absent,
so the image is stood in for by a Python that holds TensorFlow but not tfdist.
"""

from __future__ import annotations

import email
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import EXAMPLE_NEEDS, ROOT, final_weights, needs, require
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

VERSION = "0.1.0"
WHEEL_NAME = f"tfdist-{VERSION}-py3-none-any.whl"
# How an image gets tfdist: run where the built wheel lies in dist/ (an Apptainer %post, a
# Dockerfile RUN after copying dist/, `enroot start --rw` on a mounted checkout). The README shows
# this command; test_container_install_command runs it verbatim.
CONTAINER_INSTALL = f"python3 -m pip install --no-cache-dir dist/{WHEEL_NAME}"
EXAMPLE = ROOT / "examples" / "keras_train.py"
# The extras the README documents, as canonical requirement names (with their own extras).
EXTRAS = {
    "cpu": {"tensorflow-cpu"},
    "gpu": {"tensorflow[and-cuda]"},
    "tf-keras": {"tf-keras"},
    "datasets": {"tensorflow-datasets", "importlib-resources"},
    "examples": {"absl-py", "tensorflow-datasets", "importlib-resources"},
    "torch": {"torch"},
    "horovod": {"horovod"},
    "jax": {"jax", "keras"},
    "plot": {"matplotlib"},
}
# Left out of the copy the wheel is built from: what `git ls-files` leaves out at the top level.
_NOT_SOURCE_TOP = {".git", "runs", ".cache", "build", "dist", "shared", ".pytest_cache",
                   ".mypy_cache", ".ruff_cache"}


@dataclass(frozen=True)
class Built:
    wheel: Path
    tmp: Path  # holds dist/ (the wheel), src/ (the copy built from), and room for the rest


@dataclass(frozen=True)
class Venv:
    """The module recipe's venv, with tfdist installed from the wheel."""

    path: Path
    site: Path  # the venv's own site-packages
    module: Path  # the stand-in for the module's site-packages (PYTHONPATH)
    dist: Path  # the directory that holds the wheel
    install: subprocess.CompletedProcess[str]
    work: Path  # an empty working directory: the checkout's tfdist is not on sys.path
    data: Path  # the digits data, written by the first example that runs

    @property
    def bin(self) -> Path:
        return self.path / "bin"

    def env(self, **extra: str) -> dict[str, str]:
        return _env(self.module, self.bin, **extra)

    def run(self, args: list[str | Path], *, cwd: Path | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return _run(args, self.env(), cwd or self.work, timeout)


def _env(module: Path, bin_dir: Path, **extra: str) -> dict[str, str]:
    """A user's shell after `module load` and `source VENV/bin/activate`, with pip offline and
    deaf to this machine's pip configuration."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "TFDIST_", "SLURM_", "PYTHON"))
           and k not in ("TF_CONFIG", "VIRTUAL_ENV")}
    env.update(PYTHONPATH=str(module), PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1",
               PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1",
               PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
               TF_CPP_MIN_LOG_LEVEL="2", **extra)
    return env


def _run(args: list[str | Path], env: Mapping[str, str], cwd: Path,
         timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], cwd=cwd, env=dict(env), capture_output=True,
                          text=True, timeout=timeout, check=False)


def _out(run: subprocess.CompletedProcess[str]) -> str:
    return (f"exit {run.returncode}\n--- stdout\n{run.stdout[-4000:]}\n"
            f"--- stderr\n{run.stderr[-4000:]}")


def _base_python() -> str:
    """The interpreter this venv was made from: a module system's Python in the recipe."""
    base = getattr(sys, "_base_executable", None)
    if base and Path(base).exists():
        return base
    return str(Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}")


def _site_packages(venv: Path) -> Path:
    (site,) = venv.glob("lib/python*/site-packages")
    return site


def _dists(path: Path) -> dict[str, str]:
    """Canonical name -> version of the distributions installed in ``path``."""
    return {canonicalize_name(d.metadata["Name"]): d.version
            for d in importlib.metadata.distributions(path=[str(path)])}


def _copy_ignore(directory: str, names: list[str]) -> set[str]:
    top = Path(directory).resolve() == ROOT
    return {n for n in names
            if n == "__pycache__" or n.endswith((".egg-info", ".pyc"))
            or (top and (n in _NOT_SOURCE_TOP or n.startswith(".venv")))}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """``python -m build --wheel --no-isolation`` from a copy of the checkout: the setuptools
    and wheel of this venv build it, so nothing is downloaded."""
    if importlib.util.find_spec("build") is None:
        pytest.fail("the `build` package is missing: `make venv` installs requirements/test.txt")
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=_copy_ignore, symlinks=True)
    run = _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir",
                tmp / "dist", src], os.environ, tmp, timeout=300)
    assert run.returncode == 0, _out(run)
    wheels = sorted((tmp / "dist").glob("*.whl"))
    assert [w.name for w in wheels] == [WHEEL_NAME], _out(run)
    return Built(wheels[0], tmp)


@pytest.fixture(scope="module")
def module_site(built: Built) -> Path:
    """A site's TensorFlow module, as Lmod TensorFlow modules commonly provide it: a
    site-packages directory on PYTHONPATH that holds TensorFlow and its dependencies.

    The closest honest stand-in on this machine: this test venv's own site-packages (real
    TensorFlow, Keras, NumPy, absl, tensorflow-datasets, scikit-learn...), entry by entry as
    symbolic links, less tfdist itself (the editable install of the checkout is what a module
    does not have), the ``.pth`` files (Python reads none on PYTHONPATH) and pip (a module's
    PYTHONPATH does not carry one: the venv's own pip installs).
    """
    spec = importlib.util.find_spec("tensorflow")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("TensorFlow is not installed here: there is no module to stand in for")
    source = Path(next(iter(spec.submodule_search_locations))).parent
    module = built.tmp / "module" / "site-packages"
    module.mkdir(parents=True)
    for entry in source.iterdir():
        name = entry.name
        if (name.startswith(("tfdist", "__editable__", "pip-")) or name.endswith(".pth")
                or name in ("pip", "__pycache__")):
            continue
        (module / name).symlink_to(entry)
    assert "tfdist" not in _dists(module)
    return module


@pytest.fixture(scope="module")
def venv(built: Built, module_site: Path) -> Venv:
    """The module recipe, offline:

        python -m venv --system-site-packages VENV    # the module's Python
        VENV/bin/python -m pip install --no-index --find-links DIST tfdist
    """
    path = built.tmp / "venv"
    made = _run([_base_python(), "-m", "venv", "--system-site-packages", path],
                _env(module_site, path / "bin"), built.tmp)
    assert made.returncode == 0, _out(made)
    work = built.tmp / "work"
    work.mkdir()
    install = _run([path / "bin" / "python", "-m", "pip", "install", "--no-index",
                    "--find-links", built.wheel.parent, "tfdist"],
                   _env(module_site, path / "bin"), work, timeout=180)
    assert install.returncode == 0, _out(install)
    return Venv(path, _site_packages(path), module_site, built.wheel.parent, install, work,
                built.tmp / "data")


# --------------------------------------------------------------------------------------------
# The wheel


def test_wheel_holds_every_package_and_data_file(built: Built):
    with zipfile.ZipFile(built.wheel) as whl:
        names = set(whl.namelist())
        entry_points = whl.read(f"tfdist-{VERSION}.dist-info/entry_points.txt").decode()
        top_level = whl.read(f"tfdist-{VERSION}.dist-info/top_level.txt").decode().split()
    source = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tfdist").rglob("*")
              if p.is_file() and "__pycache__" not in p.parts
              and (p.suffix in (".py", ".npz") or p.name == "py.typed")}
    packaged = {n for n in names if n.startswith("tfdist/")}
    assert source - packaged == set(), "missing from the wheel"
    assert {n for n in packaged if not n.endswith(".py")} == {
        "tfdist/py.typed", "tfdist/datasets/digits.npz"}
    for package in ("jobs", "datasets", "doctor", "env", "backends", "horovod", "torch"):
        assert f"tfdist/{package}/__init__.py" in packaged
    # Only tfdist: no tests/, examples/ or benchmarks/ package lands in site-packages.
    assert {n.split("/")[0] for n in names} == {"tfdist", f"tfdist-{VERSION}.dist-info"}
    assert top_level == ["tfdist"]
    assert re.search(r"^tfdist = tfdist\.cli:main$", entry_points, re.M), entry_points


def test_wheel_metadata_declares_the_extras_and_no_tensorflow(built: Built):
    with zipfile.ZipFile(built.wheel) as whl:
        metadata = email.message_from_bytes(whl.read(f"tfdist-{VERSION}.dist-info/METADATA"))
    requirements = [Requirement(r) for r in metadata.get_all("Requires-Dist") or []]

    def names(extra: str) -> set[str]:
        found = set()
        for r in requirements:
            if r.marker is None or r.marker.evaluate({"extra": extra}):
                extras = f"[{','.join(sorted(r.extras))}]" if r.extras else ""
                found.add(canonicalize_name(r.name) + extras)
        return found

    # Nothing heavy unconditionally: TensorFlow comes from the module, the image or an extra.
    assert names("") == {"pyyaml"}
    for extra, expected in EXTRAS.items():
        assert names(extra) - names("") == expected, extra
    assert set(metadata.get_all("Provides-Extra") or []) == {*EXTRAS, "test"}
    assert metadata["Requires-Python"] == ">=3.10"
    assert metadata["Name"] == "tfdist" and metadata["Version"] == VERSION


# --------------------------------------------------------------------------------------------
# Into a site's TensorFlow module


def test_module_install_adds_tfdist_and_nothing_else(venv: Venv):
    assert venv.install.returncode == 0, _out(venv.install)
    assert f"Successfully installed tfdist-{VERSION}" in venv.install.stdout, _out(venv.install)
    # Every dependency was there already (the install was offline): no second TensorFlow,
    # no second anything. pip and setuptools are the venv's own, from ensurepip.
    own = _dists(venv.site)
    assert set(own) - {"pip", "setuptools"} == {"tfdist"}, own
    assert not [p for p in venv.site.iterdir() if p.name.lower().startswith("tensorflow")]


def test_the_module_tensorflow_and_the_installed_tfdist_are_imported(venv: Venv):
    # The README's check, then `tfdist.init()` in one plain process.
    run = venv.run(["python", "-c", "import tensorflow, tfdist; print(tensorflow.__file__); "
                    "print(tfdist.__file__)"])
    assert run.returncode == 0, _out(run)
    tensorflow_file, tfdist_file = run.stdout.split()
    assert Path(tensorflow_file).is_relative_to(venv.module), tensorflow_file
    assert Path(tfdist_file).is_relative_to(venv.site), tfdist_file
    run = venv.run(["python", "-c", "import tfdist; d = tfdist.init(); print(d.backend)"])
    assert run.returncode == 0, _out(run)
    assert run.stdout.split() == ["single"], _out(run)


def test_the_console_script_runs(venv: Venv):
    run = venv.run([venv.bin / "tfdist", "--help"])
    assert run.returncode == 0 and "launch" in run.stdout and "doctor" in run.stdout, _out(run)
    run = venv.run([venv.bin / "tfdist", "env"])
    assert run.returncode == 0, _out(run)
    # One process: `auto` plans MirroredStrategy, which init turns into the single-process
    # backend when the process sees one device (test above).
    assert "backend: mirrored" in run.stdout, _out(run)
    tensorflow = _dists(venv.module)[_module_tensorflow(venv)]
    assert f"'tensorflow': '{tensorflow}'" in run.stdout, _out(run)
    assert f"'tfdist': '{VERSION}'" in run.stdout, _out(run)


# --------------------------------------------------------------------------------------------
# The examples with the installed wheel (from an empty working directory)


def _imported_tfdist(venv: Venv) -> Path:
    """The tfdist that the example imports: its sys.path[0] is examples/, then PYTHONPATH and
    the venv (a separate process with the same path, environment and working directory)."""
    run = venv.run(["python", "-c", f"import sys; sys.path.insert(0, {str(EXAMPLE.parent)!r}); "
                    "import tfdist; print(tfdist.__file__)"])
    assert run.returncode == 0, _out(run)
    return Path(run.stdout.strip())


@needs(*EXAMPLE_NEEDS["keras_train.py"])  # the module is this Python's site-packages
def test_the_example_trains_with_the_installed_wheel(venv: Venv):
    assert _imported_tfdist(venv).is_relative_to(venv.site)
    run = venv.run(["python", EXAMPLE, "--epochs=1", f"--data_dir={venv.data}",
                    f"--model_dir={venv.work / 'single'}"], timeout=300)
    assert run.returncode == 0, _out(run)
    assert "backend single" in run.stdout and "test accuracy" in run.stdout, _out(run)
    weights = final_weights([run.stdout])
    assert sorted(weights) == [0] and weights[0][0] == 1, _out(run)
    assert (venv.work / "single" / "final.keras").is_file()


@pytest.mark.multiprocess
@needs(*EXAMPLE_NEEDS["keras_train.py"])
def test_launch_two_workers_with_the_installed_wheel(venv: Venv):
    run = venv.run([venv.bin / "tfdist", "launch", "-n", "2", EXAMPLE, "--epochs=1",
                    f"--data_dir={venv.data}", f"--model_dir={venv.work / 'launch'}"],
                   timeout=300)
    assert run.returncode == 0, _out(run)
    assert "[0] tfdist: 2 worker(s), 2 replica(s), backend mwms" in run.stdout, _out(run)
    assert "[0] test loss" in run.stdout and "test accuracy" in run.stdout, _out(run)
    weights = final_weights([run.stdout])
    assert sorted(weights) == [0, 1] and len(set(weights.values())) == 1, weights


# --------------------------------------------------------------------------------------------
# The extras
#
# A plain venv with `tfdist[cpu]` or `tfdist[gpu]` downloads TensorFlow, which no test does:
# the wheel's metadata (test_wheel_metadata_declares_the_extras_and_no_tensorflow) is the
# check of what those extras ask for. What runs here is pip's resolver, offline, against the
# module, whose TensorFlow is the tensorflow-cpu wheel with everything it needs installed
# (requirements/test.txt): the state a plain venv with the cpu extra ends in.


def _dry_run(venv: Venv, spec: str) -> tuple[subprocess.CompletedProcess[str], dict | None]:
    report = venv.work / f"report-{re.sub(r'[^a-z-]', '', spec)}.json"
    report.unlink(missing_ok=True)
    run = venv.run(["python", "-m", "pip", "install", "--dry-run", "--no-index",
                    "--find-links", venv.dist, "--report", report, spec])
    return run, json.loads(report.read_text()) if report.exists() else None


def _module_tensorflow(venv: Venv) -> str:
    """The distribution that installed the module's tensorflow/ package."""
    for dist in importlib.metadata.distributions(path=[str(venv.module)]):
        if any(str(f) == "tensorflow/__init__.py" for f in dist.files or ()):
            return canonicalize_name(dist.metadata["Name"])
    raise AssertionError("no distribution in the module owns tensorflow/")


@pytest.mark.parametrize("extra", ["cpu", "examples"])
def test_an_extra_the_module_satisfies_installs_nothing_more(venv: Venv, extra: str):
    if extra == "examples":  # the module satisfies it where this Python has them
        require("tensorflow_datasets")
    assert _module_tensorflow(venv) == "tensorflow-cpu"
    run, report = _dry_run(venv, f"tfdist[{extra}]")
    assert run.returncode == 0, _out(run)
    assert report is not None and report["install"] == [], report


@pytest.mark.parametrize("extra", ["gpu", "tf-keras"])
def test_an_extra_naming_another_tensorflow_wants_a_second_one(venv: Venv, extra: str):
    # [gpu] asks for the `tensorflow` wheel and tf_keras declares it too: over the module's
    # tensorflow-cpu that is a second TensorFlow in the same tensorflow/ folder, so the module
    # recipe installs tfdist with no TensorFlow extra (and tf_keras with --no-deps).
    assert _module_tensorflow(venv) == "tensorflow-cpu"
    run, _ = _dry_run(venv, f"tfdist[{extra}]")
    assert run.returncode != 0, _out(run)
    assert re.search(r"No matching distribution found for tensorflow(?![-_\w])", run.stderr), \
        _out(run)


# --------------------------------------------------------------------------------------------
# Containers: what the rendered job scripts expect of the image, and how it gets tfdist


@pytest.mark.parametrize("name", ["mwms-enroot", "mwms-apptainer"])
def test_container_job_scripts_run_tfdist_from_the_image(venv: Venv, name: str):
    # The installed wheel renders the same scripts as the checkout (jobscripts/ is the golden).
    run = venv.run([venv.bin / "tfdist", "job", f"jobscripts/configs/{name}.yaml"], cwd=ROOT)
    assert run.returncode == 0, _out(run)
    script = run.stdout
    assert script == (ROOT / "jobscripts" / f"{name}.sbatch").read_text()
    # The scripts install nothing: the image's Python imports tfdist (the doctor step runs
    # `-m tfdist`, the training step a script whose sys.path[0] is examples/, not the checkout).
    assert "pip install" not in script
    assert re.search(r"^\s*python3? -m tfdist doctor( \|\| code=\$\?)?$", script, re.M), script
    assert re.search(r"python3? \S*examples/keras_train\.py ", script), script


def test_container_install_command(built: Built, module_site: Path):
    """CONTAINER_INSTALL, verbatim, into a stand-in for an image's Python: TensorFlow installed
    (the module's packages), tfdist not, pip from the base interpreter (the image's system pip).
    Offline (PIP_NO_INDEX) since everything but tfdist is there."""
    image = built.tmp / "image"
    made = _run([_base_python(), "-m", "venv", "--system-site-packages", "--without-pip", image],
                os.environ, built.tmp)
    assert made.returncode == 0, _out(made)
    env = _env(module_site, image / "bin", PIP_NO_INDEX="1")
    checkout = built.tmp / "src"  # as bound at /workspace

    def train_help() -> subprocess.CompletedProcess[str]:
        return _run(["python3", "examples/keras_train.py", "--helpshort"], env, checkout)

    # A bound checkout alone is not enough: `-m tfdist` finds it in the working directory, the
    # training script does not.
    run = _run(["python3", "-m", "tfdist", "--version"], env, checkout)
    assert run.returncode == 0, _out(run)
    run = train_help()
    assert run.returncode != 0 and "No module named 'tfdist'" in run.stderr, _out(run)

    run = _run(["bash", "-c", CONTAINER_INSTALL], env, built.tmp, timeout=180)
    assert run.returncode == 0, _out(run)
    assert f"Successfully installed tfdist-{VERSION}" in run.stdout, _out(run)
    assert set(_dists(_site_packages(image))) == {"tfdist"}
    run = train_help()  # absl's usage (it exits 1 after printing it): the imports all worked
    assert "--epochs" in run.stdout and not run.stderr.strip(), _out(run)
    run = _run(["python3", "-c", "import tfdist; print(tfdist.__file__)"], env, built.tmp)
    assert Path(run.stdout.strip()).is_relative_to(_site_packages(image)), _out(run)


def test_the_readme_shows_the_tested_commands():
    """The install commands these tests run are the README's, word for word."""
    import shlex

    from test_readme import commands

    shown = commands((ROOT / "README.md").read_text())  # normalised by shlex
    for command in (CONTAINER_INSTALL,
                    "python -m venv --system-site-packages ~/venvs/tfdist",
                    f"python -m pip install /path/to/dist/{WHEEL_NAME}"):
        assert shlex.join(shlex.split(command)) in shown, command
