"""tfdist.background: the names of a save's folders, which are stale, when every rank's files
are durable, and the writer thread that keeps one save in flight."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tfdist.background import (
    Writer,
    complete,
    fsync_folder,
    mark_done,
    partial_name,
    save_number,
    stale_partials,
    wait_for_ranks,
)


@pytest.mark.parametrize(("name", "number"), [
    (partial_name(0), 0),
    (partial_name(12), 12),
    (".preempted.partial-", None),
    (".preempted.partial-3x", None),
    ("preempted", None),
    ("preempted.old", None),
    (".preempted.partial", None),  # the synchronous save's folder
])
def test_a_partial_folders_save_number_is_read_from_its_name(name, number):
    assert save_number(name) == number


def test_partial_folders_of_earlier_saves_are_stale():
    names = ["preempted", "preempted.old", partial_name(1), partial_name(3), partial_name(4),
             "checkpoint.keras", partial_name(10)]
    assert stale_partials(names, 4) == [partial_name(1), partial_name(3)]
    assert stale_partials(names, 0) == []


@pytest.mark.parametrize(("names", "world", "done"), [
    ([".done-0", ".done-1", "weights.npz"], 2, True),
    ([".done-0", "weights.npz"], 2, False),
    ([".done-1"], 1, False),
    ([], 0, True),
])
def test_a_save_is_complete_with_every_ranks_marker(names, world, done):
    assert complete(names, world) is done


def test_the_chief_waits_for_every_ranks_marker_or_gives_up(tmp_path):
    folder = tmp_path / partial_name(1)
    folder.mkdir()
    (folder / "weights.npz").write_bytes(b"x" * 100)
    fsync_folder(str(folder))
    mark_done(str(folder), 0)
    assert not wait_for_ranks(str(folder), 2, 0.1)  # rank 1 never wrote: not committed
    assert not wait_for_ranks(str(folder), 2, 10, given_up=lambda: True)
    threading.Timer(0.2, mark_done, (str(folder), 1)).start()
    assert wait_for_ranks(str(folder), 2, 10)


def test_a_ranks_marker_is_made_durable_though_the_chief_commits_its_folder_at_once(
        tmp_path, monkeypatch):
    # The chief renames the folder (its commit) as soon as the last marker exists; the rank
    # still flushes the marker and the folder (by the folder's path this raced the rename:
    # ENOENT, a rank's save failed on JAX 1 run in 8).
    folder, committed = tmp_path / partial_name(2), tmp_path / "preempted"
    folder.mkdir()
    opened = os.open

    def open_then_commit(path, flags, *args, **kwargs):
        fd = opened(path, flags, *args, **kwargs)
        if str(path).startswith(".done-"):
            os.rename(folder, committed)  # the chief, between the marker and its flush
        return fd

    monkeypatch.setattr(os, "open", open_then_commit)
    mark_done(str(folder), 1)
    assert float((committed / ".done-1").read_text()) > 0


def test_one_write_is_in_flight_and_the_next_waits_for_it():
    writer, order = Writer(), []

    def write(name, seconds):
        def run():
            time.sleep(seconds)
            order.append(name)
        return run

    assert writer.submit(write("first", 0.3)) < 0.1  # nothing in flight: no wait
    assert writer.in_flight
    waited = writer.submit(write("second", 0))
    assert waited >= 0.2 and order[0] == "first"
    writer.wait()
    assert order == ["first", "second"] and not writer.in_flight
    assert writer.last_seconds is not None


def test_a_failed_write_is_raised_on_the_training_thread_once():
    writer = Writer()

    def full_disk():
        raise OSError(28, "No space left on device")

    writer.submit(full_disk)
    with pytest.raises(OSError, match="No space left"):
        writer.wait()
    assert writer.wait() == pytest.approx(0, abs=0.1)  # raised once; nothing in flight
    writer.submit(full_disk)
    with pytest.raises(OSError):
        writer.submit(lambda: None)  # the next save hears of it before it starts


def test_a_snapshot_restores_the_models_weights_and_its_optimizers_state(tmp_path):
    import keras
    import numpy as np

    from tfdist.keras import snapshot

    def model(width=4):
        made = keras.Sequential([keras.Input((3,)), keras.layers.Dense(width),
                                 keras.layers.Dense(1)])
        made.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return made

    x, y = np.ones((8, 3), "float32"), np.zeros((8, 1), "float32")
    trained = model()
    trained.fit(x, y, epochs=2, verbose=0)
    taken = snapshot.take(trained)
    values = {key: value.copy() for key, value in taken.arrays().items()}
    snapshot.write(str(tmp_path), taken)
    trained.fit(x, y, epochs=1, verbose=0)
    again = snapshot.take(trained, reuse=taken)
    assert again.buffer is taken.buffer  # the same variables: the same buffer, copied again
    assert not np.array_equal(again.arrays()["w0"], values["w0"])
    fresh = model()
    fresh.optimizer.build(fresh.trainable_variables)  # fit's resume builds it first
    snapshot.restore(fresh, str(tmp_path / snapshot.FILE))
    got = snapshot.take(fresh).arrays()
    assert sorted(got) == sorted(values) and any(k.startswith("o") for k in got)
    for key, value in values.items():
        np.testing.assert_array_equal(got[key], value)
    assert int(fresh.optimizer.iterations.numpy()) == 2  # 2 epochs of one step
    other = model(width=5)
    other.optimizer.build(other.trainable_variables)
    assert snapshot.take(other, reuse=taken).buffer is not taken.buffer  # other variables
    with pytest.raises(ValueError, match="has shape"):
        snapshot.restore(other, str(tmp_path / snapshot.FILE))


@pytest.mark.parametrize(("specs", "index", "size"), [
    ([], [], 0),
    ([("w0", "<f4", (3,))], [["w0", "<f4", [3], 0]], 4096),
    ([("w0", "<f4", (1024,)), ("o0", "<i8", ())],
     [["w0", "<f4", [1024], 0], ["o0", "<i8", [], 4096]], 8192),
    ([("w0", "<f4", (1025,)), ("w1", "<f2", (0, 4)), ("o0", "<f4", (2, 3))],
     [["w0", "<f4", [1025], 0], ["w1", "<f2", [0, 4], 8192], ["o0", "<f4", [2, 3], 8192]],
     12288),
])
def test_each_array_starts_on_a_4_kib_boundary(specs, index, size):
    from tfdist.keras import snapshot

    assert snapshot.layout(specs) == (index, size)


@pytest.mark.parametrize("where", ["direct", "no O_DIRECT", "refused at open",
                                   "refused at write"])
def test_a_snapshot_reads_back_the_same_written_directly_or_through_the_page_cache(
        tmp_path, monkeypatch, where):
    """This disk takes direct I/O; where a platform has none or a file system refuses it (a
    stand-in: os.open or os.write answering EINVAL, as Linux does), the same bytes go through
    the page cache."""
    import errno

    import numpy as np

    from tfdist.keras import snapshot

    class Variable:
        def __init__(self, value):
            self.value, self.shape = value, value.shape

        def assign(self, value):
            self.value = np.array(value)

    def refuse(call, name):
        def refused(*args, **kwargs):
            if name == "write" or args[1] & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return call(*args, **kwargs)
        return refused

    if where == "no O_DIRECT":
        monkeypatch.delattr(os, "O_DIRECT")
    elif where.startswith("refused"):
        name = "open" if where.endswith("open") else "write"
        monkeypatch.setattr(os, name, refuse(getattr(os, name), name))
    rng = np.random.default_rng(0)
    model = type("Model", (), {})()
    model.weights = [Variable(rng.normal(size=(70, 33)).astype("float32")),
                     Variable(np.arange(5, dtype="int64")), Variable(np.float32(2.5))]
    model.optimizer = None
    taken = snapshot.take(model)
    snapshot.write(str(tmp_path), taken)
    assert os.path.getsize(tmp_path / "variables.bin") == taken.size
    written = [np.array(w.value) for w in model.weights]
    for w in model.weights:
        w.value = np.zeros_like(w.value)
    snapshot.restore(model, str(tmp_path / snapshot.FILE))
    for w, value in zip(model.weights, written, strict=True):
        np.testing.assert_array_equal(w.value, value)


# --- the torch shim's dist.save in the background (tfdist/torch/saves.py) --------------------

def test_a_torch_states_host_copy_is_reused_and_holds_the_values_at_the_copy():
    torch = pytest.importorskip("torch")
    from collections import namedtuple

    from tfdist.torch import saves

    pair = namedtuple("pair", "a b")
    weights = torch.arange(6.0).reshape(2, 3)
    state = {"model": {"w": weights}, "steps": [torch.tensor(3), 7], "pair": pair(weights, "x"),
             "epoch": 2}
    copied, buffers = saves.host_copy(state)
    assert sorted(buffers) == [("model", "w"), ("pair", 0), ("steps", 0)]
    assert copied["epoch"] == 2 and copied["steps"][1] == 7 and copied["pair"].b == "x"
    assert isinstance(copied["pair"], pair) and isinstance(copied["steps"], list)
    weights.add_(100.0)  # the training goes on: the copy keeps the saved values
    assert copied["model"]["w"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    again, reused = saves.host_copy(state, buffers)  # the same shapes: the same host memory
    assert all(reused[k].data_ptr() == buffers[k].data_ptr() for k in buffers)
    assert again["model"]["w"][0, 0].item() == 100.0
    grown = {**state, "model": {"w": torch.zeros(4, 3)}}  # another shape: new memory
    _, made = saves.host_copy(grown, reused)
    assert made[("model", "w")].data_ptr() != reused[("model", "w")].data_ptr()


def test_a_torch_save_replaces_the_file_whole_or_leaves_the_previous_one(tmp_path):
    torch = pytest.importorskip("torch")
    from tfdist.torch import saves

    target = str(tmp_path / "ckpt" / "state.pt")
    saves.write_atomically({"step": 1}, target)
    with pytest.raises(Exception):  # noqa: B017 (pickle's own error: a lambda)
        saves.write_atomically({"step": 2, "bad": lambda: None}, target)
    assert torch.load(target)["step"] == 1 and os.listdir(tmp_path / "ckpt") == ["state.pt"]


def test_a_torch_background_save_writes_the_state_of_its_step_and_raises_a_failed_write(
        tmp_path):
    torch = pytest.importorskip("torch")
    from tfdist.torch import saves

    writer = saves.BackgroundSaves()
    weights = torch.ones(3)
    target = str(tmp_path / "state.pt")
    writer.save({"w": weights, "step": 4}, target)
    weights.mul_(5.0)  # the next steps, while the file is written
    writer.wait()
    assert torch.load(target)["w"].tolist() == [1.0, 1.0, 1.0]
    settings = pytest.importorskip("torch.utils.serialization").config.save
    assert settings.compute_crc32  # written without the checksum, the setting put back
    (tmp_path / "taken").write_text("a file where the folder would be")
    writer.save({"w": weights}, str(tmp_path / "taken" / "state.pt"))
    with pytest.raises(OSError):
        writer.save({"w": weights}, target)  # the failed write, raised at the next save
    writer.save({"w": weights}, target)  # once: the next save goes on
    writer.wait()
    assert torch.load(target)["w"].tolist() == [5.0, 5.0, 5.0]


def test_a_torch_save_made_in_memory_grows_its_buffer_and_writes_the_file_whole(tmp_path):
    torch = pytest.importorskip("torch")
    from tfdist.torch import saves

    memory = saves.Memory()  # one page: torch.save's file outgrows it
    state = {"w": torch.arange(5000, dtype=torch.float32), "step": 3}
    target = str(tmp_path / "state.pt")
    saves.write_atomically(state, target, checksum=False, memory=memory)
    assert len(memory.buffer) >= memory.size > 20000 and len(memory.aligned()) % 4096 == 0
    assert os.path.getsize(target) == memory.size  # the direct write's last page cut off
    loaded = torch.load(target)
    assert loaded["step"] == 3 and torch.equal(loaded["w"], state["w"])
    saves.write_atomically({"step": 4}, target, memory=memory)  # the buffer reused, rewound
    assert torch.load(target) == {"step": 4} and os.path.getsize(target) == memory.size
