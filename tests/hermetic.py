"""pytest plugin: no test sees the machine's GPUs, except those marked ``gpu``.

tfdist reads the GPUs from ``CUDA_VISIBLE_DEVICES`` and, where it is unset, counts the
``/dev/nvidiaN`` device files and lets the framework count CUDA devices: the same test would
expect other plans, collectives and doctor findings on a machine with GPUs. So for the whole
session this plugin sets ``CUDA_VISIBLE_DEVICES=""``, which tfdist, TensorFlow and torch read as
"no GPU", in the pytest process and so in every process a test starts (pytest-xdist's workers
included). A test that sets the variable itself, or removes it to test the unset case, still
does so.

A test about the machine's real GPUs is marked ``gpu``. It gets the machine's value back, unset
where it was unset, from the start of its setup to the end of its teardown, and skips with the
reason where the machine has no GPU as tfdist sees it (the value names none, or it is unset and
no ``/dev/nvidiaN`` exists)::

    @pytest.mark.gpu
    def test_the_example_trains_on_the_gpu():
        run = subprocess.run([sys.executable, "examples/torch_train.py"], ...)  # all GPUs

TensorFlow and torch read the variable once per process, at their first look at CUDA, so a
``gpu`` test uses the GPUs in processes it starts, not in the pytest process; fixtures of module
or wider scope that it uses should serve ``gpu`` tests only (set up for another test, they saw
``""``). The machine's value travels to xdist's workers, and to pytest sessions that tests start,
in ``PYTEST_MACHINE_CUDA_VISIBLE_DEVICES`` (JSON: ``null`` for unset).
"""

from __future__ import annotations

import json
import os
from collections.abc import Generator

import pytest

from tfdist import devices

__all__ = ["MACHINE_VARIABLE", "machine_gpus", "no_gpu_reason"]

VARIABLE = "CUDA_VISIBLE_DEVICES"
MACHINE_VARIABLE = "PYTEST_MACHINE_CUDA_VISIBLE_DEVICES"
_HIDDEN = ""  # tfdist.devices.NO_GPUS: "no GPU" to tfdist and to CUDA
_before: dict[str, str | None] = {}


def machine_gpus() -> str | None:
    """The machine's ``CUDA_VISIBLE_DEVICES`` as the outermost pytest session found it; None
    for unset."""
    if MACHINE_VARIABLE in os.environ:
        value: str | None = json.loads(os.environ[MACHINE_VARIABLE])
        return value
    return os.environ.get(VARIABLE)


def no_gpu_reason(visible: str | None, node_gpus: int) -> str | None:
    """Why a ``gpu`` test skips on a machine with this ``CUDA_VISIBLE_DEVICES`` (None: unset)
    and ``node_gpus`` device files, or None where it has a GPU (pure)."""
    if visible is None:
        if node_gpus:
            return None
        where = "CUDA_VISIBLE_DEVICES is unset and there is no /dev/nvidiaN device file"
    elif visible.strip() not in devices.NO_GPUS and any(i.strip() for i in visible.split(",")):
        return None
    else:
        where = f"CUDA_VISIBLE_DEVICES={visible}"
    return f"needs a GPU, and this machine has none ({where})"


def _set(value: str | None) -> None:
    if value is None:
        os.environ.pop(VARIABLE, None)
    else:
        os.environ[VARIABLE] = value


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "gpu: about the machine's real GPUs: sees its CUDA_VISIBLE_DEVICES (hidden "
        "from every other test) and skips with the reason where it has no GPU")
    _before.update({name: os.environ.get(name) for name in (VARIABLE, MACHINE_VARIABLE)})
    os.environ[MACHINE_VARIABLE] = json.dumps(machine_gpus())
    os.environ[VARIABLE] = _HIDDEN


def pytest_unconfigure(config: pytest.Config) -> None:
    for name, value in _before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _before.clear()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    reason = no_gpu_reason(machine_gpus(), devices.node_gpus())
    if reason is None:
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    if item.get_closest_marker("gpu") is None:
        yield
        return
    _set(machine_gpus())
    try:
        yield
    finally:
        _set(_HIDDEN)
