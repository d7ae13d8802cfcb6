"""Reads verify what they read (issue 22, items 1, 2, 6, 11): a file read again (a
stacked array sliced per layer, statistics after the weights) is read from the same
file, never from a closed descriptor or another file's bytes; at most `Files.limit`
shards are open at once; a file rewritten in place while it is read is an error
naming it, for every kind of read (single file, shards, lazy, msgpack); bridge's own
sharded checkpoints keep their metadata."""

import gc
import json
import os
import resource
import threading

import jax
import numpy as np
import pytest
import safetensors.numpy

import bridge
from bridge import _buffers
from bridge._io import _checkpoint, _files, _safetensors, _sharded
from bridge._io._read import open_checkpoint
from bridge._lazy import LazyArray, ReadAhead, read_early
from bridge._port import _run

from .helpers import check_collector_paused, on_the_cpu, requires
from .test_port_stacked import EqxLooped, Scanned, X, _linen, _randomised


def write_sharded(folder, arrays: dict, per_shard: int = 1):
    """A Hugging Face sharded folder: `per_shard` arrays a shard, and its index."""
    names = list(arrays)
    weight_map = {}
    count = -(-len(names) // per_shard)
    for s in range(count):
        file = f"model-{s + 1:05d}-of-{count:05d}.safetensors"
        part = names[s * per_shard : (s + 1) * per_shard]
        safetensors.numpy.save_file({k: arrays[k] for k in part}, folder / file)
        weight_map.update(dict.fromkeys(part, file))
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


def values(n: int) -> dict:
    return {f"layers.{i}.w": np.full(3, i, np.float32) for i in range(n)}


# --- item 1: a file read again is the same file --------------------------------------


def test_an_array_read_again_after_another_file_was_opened(tmp_path):
    """A lazy array read, its shard's every name read once, then a new file opened
    (which may get the shard's old descriptor number), then the array read again:
    the same bytes, never the new file's and never EBADF."""
    index = write_sharded(tmp_path, values(2))
    other = tmp_path / "other.bin"
    other.write_bytes(b"\xff" * 4096)
    with open_checkpoint(index) as contents:
        lazy = _sharded.FORMAT.lazy(contents)
        first = lazy["layers.0.w"].read()
        with open(other, "rb"):  # takes the lowest free descriptor number
            again = lazy["layers.0.w"].read()
            np.testing.assert_array_equal(again, first)
            np.testing.assert_array_equal(lazy["layers.1.w"].read(), [1, 1, 1])


def test_a_stacked_sharded_file_ports_into_per_layer_layers(tmp_path):
    """`load(folder, like=per-layer model)` of an `nn.scan` model's folder (names
    only, no metadata), one array a shard: each stacked array is read once per layer
    slice, all from its shard (closing a shard once each name was read once failed
    the second slice with EBADF, or read another file's bytes)."""
    source = _randomised(_linen(Scanned(), 0))
    single = tmp_path / "single.safetensors"
    bridge.save(single, source)
    index = write_sharded(tmp_path, safetensors.numpy.load_file(single))
    single.unlink()
    assert bridge.load(index).blocks.Dense_0.kernel.shape[0] == 3  # stacked
    target = bridge.load(index, like=EqxLooped(jax.random.key(1)))
    module, variables = source
    np.testing.assert_allclose(
        jax.vmap(target)(X), module.apply(variables, X), rtol=1e-5, atol=1e-5
    )


@requires("NNX")
def test_a_sharded_training_checkpoint_resumes(tmp_path):
    """The optimizer state is read after the model's arrays, from the same shards."""
    import optax
    from flax import nnx

    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    index = tmp_path / "model.safetensors.index.json"
    bridge.save_training(index, model, optimizer, step=7)
    like = nnx.Linear(2, 3, rngs=nnx.Rngs(1))
    state = bridge.load(
        index,
        like=like,
        opt_state_like=nnx.Optimizer(like, optax.adam(1e-3), wrt=nnx.Param),
    )
    assert state.step == 7
    np.testing.assert_array_equal(state.model.kernel[...], model.kernel[...])


# --- item 6: bridge's own sharded checkpoints keep their metadata ---------------------


@requires("NNX")
def test_bridge_sharded_checkpoints_keep_roles_and_framework(tmp_path):
    from flax import nnx

    model = nnx.BatchNorm(3, rngs=nnx.Rngs(0))
    index = tmp_path / "m.safetensors.index.json"
    bridge.save(index, model)
    tree = bridge.load(index)
    assert bridge.roles(tree).mean == "batch_stats"
    back = bridge.load(index, like=nnx.BatchNorm(3, rngs=nnx.Rngs(1)))
    assert isinstance(back, nnx.BatchNorm)


# --- item 11: descriptors bounded ----------------------------------------------------


def test_many_shards_load_under_a_low_descriptor_limit(tmp_path):
    """200 shards with room for 80 more descriptors than the process holds: at most
    `Files.limit` (64) shards are open at once (every shard was kept open before)."""
    index = write_sharded(tmp_path, values(200))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (held + 80, hard))
    try:
        tree = bridge.load(index)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert float(tree.layers[199].w[0]) == 199
    assert len(os.listdir("/proc/self/fd")) <= held + 1  # every shard closed


@pytest.mark.slow
def test_1100_shards_under_1024_descriptors(tmp_path):
    """The issue's case: a valid 1,100-shard checkpoint under the usual limit."""
    index = write_sharded(tmp_path, values(1100))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        tree = bridge.load(index)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert float(tree.layers[1099].w[0]) == 1099


def test_a_closed_shard_reopened_is_checked(tmp_path, monkeypatch):
    """With room for one open shard, each is closed and opened again: a shard
    replaced meanwhile (another inode) is an error naming it."""
    monkeypatch.setattr(_files.Files, "limit", 1)
    index = write_sharded(tmp_path, values(3))
    assert float(bridge.load(index).layers[2].w[0]) == 2
    with open_checkpoint(index) as contents:
        lazy = _sharded.FORMAT.lazy(contents)
        lazy["layers.0.w"].read()
        lazy["layers.1.w"].read()  # shard 1 closed
        shard = tmp_path / "model-00001-of-00003.safetensors"
        replacement = tmp_path / "new.safetensors"
        safetensors.numpy.save_file(
            {"layers.0.w": np.full(3, 9, np.float32)}, replacement
        )
        os.replace(replacement, shard)
        with pytest.raises(
            bridge.CheckpointError, match=r"model-00001-of-00003.*changed"
        ):
            lazy["layers.0.w"].read()


# --- item 2: a file changed while it is read -----------------------------------------


def rewrite_after_first_read(monkeypatch, path):
    """After the first read of array bytes (one array, or several read at once),
    rewrite `path` in place (same size, other bytes, a later modification time):
    what `cp v2 ckpt/model.safetensors` does."""
    calls = []

    def rewrite() -> None:
        calls.append(1)
        if len(calls) == 1:
            data = bytearray(path.read_bytes())
            data[-4:] = b"\x01\x02\x03\x04"
            stat = os.stat(path)
            with open(path, "r+b") as f:  # in place: the same inode
                f.write(bytes(data))
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))

    real_at, real_into = _files.read_at, _files.read_into

    def read_at(fd, offset, count, into=None):
        out = real_at(fd, offset, count, into)
        rewrite()
        return out

    def read_into(fd, offset, buffers):
        real_into(fd, offset, buffers)
        rewrite()

    for module in ("_files", "_safetensors", "_msgpack"):
        mod = __import__(f"bridge._io.{module}", fromlist=["x"])
        for name, hook in (("read_at", read_at), ("read_into", read_into)):
            if hasattr(mod, name):
                monkeypatch.setattr(mod, name, hook)


@pytest.mark.parametrize("kind", ["single file", "sharded", "lazy"])
def test_a_file_rewritten_while_read_is_an_error_naming_it(tmp_path, monkeypatch, kind):
    arrays = values(4)
    if kind == "sharded":
        index = write_sharded(tmp_path, arrays, per_shard=4)
        path, changed = index, tmp_path / "model-00001-of-00001.safetensors"
    else:
        path = changed = tmp_path / "model.safetensors"
        safetensors.numpy.save_file(arrays, path)
    with open_checkpoint(path) as contents:
        rewrite_after_first_read(monkeypatch, changed)
        with pytest.raises(bridge.CheckpointError, match=rf"{changed.name}.*changed"):
            if kind == "lazy":
                for array in _safetensors.FORMAT.lazy(contents).values():
                    array.read()
            else:
                from bridge._io._read import read

                read(contents)


def test_a_msgpack_file_rewritten_while_read_is_an_error(tmp_path, monkeypatch):
    path = tmp_path / "m.msgpack"
    bridge.save(path, {"params": {"a": np.ones(4096, np.float32)}})
    rewrite_after_first_read(monkeypatch, path)
    with pytest.raises(bridge.CheckpointError, match=r"m\.msgpack.*changed"):
        bridge.load(path)


# --- the memory reads go into (bridge/_buffers.py) ------------------------------------


@on_the_cpu
def test_a_weight_read_becomes_the_jax_array_with_no_copy(tmp_path):
    path = tmp_path / "w.safetensors"
    safetensors.numpy.save_file({"w": np.arange(600_000, dtype=np.float32)}, path)
    with open_checkpoint(path) as contents:
        read = _safetensors.read_one(contents, "w")
        assert _buffers.owned(read) and read.ctypes.data % _buffers.ALIGN == 0
        placed = _buffers.to_jax(read)
    assert placed.unsafe_buffer_pointer() == read.ctypes.data  # the same memory
    assert np.array_equal(np.asarray(placed), np.arange(600_000, dtype=np.float32))


def test_the_callers_array_is_copied_once_never_shared():
    mine = np.arange(600_000, dtype=np.float32)
    placed = _buffers.to_jax(mine)
    mine[:] = -1
    assert not _buffers.owned(mine)
    assert np.array_equal(np.asarray(placed), np.arange(600_000, dtype=np.float32))
    strided = _buffers.to_jax(mine.reshape(600, 1000).T)  # XLA's transpose copies
    assert strided.shape == (1000, 600) and float(strided[0, 0]) == -1.0


@on_the_cpu
def test_a_pool_buffer_is_reused_only_once_its_arrays_are_gone():
    pool = _buffers.Pool()
    n = pool.least * 2
    pool.expect(100 * n)  # reads to come: idle buffers are kept for them
    first = pool.take(n)
    first[:] = 7
    where = first.ctypes.data
    placed = _buffers.to_jax(first.view(np.float32))  # the model holds it now
    del first
    gc.collect()
    second = pool.take(n)
    assert second.ctypes.data != where  # not given out while the JAX array lives
    second[:] = 1
    assert np.all(np.asarray(placed).view(np.uint8) == 7)
    # a weight read, transposed into a new array, then dropped: its buffer comes back
    address = second.ctypes.data
    copied = _buffers.to_jax(second.view(np.float32).reshape(2, -1).T)
    del second
    gc.collect()
    reused = pool.take(n)
    assert reused.ctypes.data == address
    assert np.all(np.asarray(copied).view(np.uint8) == 1)
    del placed
    gc.collect()  # the model's buffer goes back too
    assert pool.take(n).ctypes.data == where
    pool.close()  # a closed pool keeps nothing
    del reused
    gc.collect()
    assert not pool._idle


def test_a_pool_keeps_idle_buffers_only_for_the_reads_still_expected():
    pool = _buffers.Pool()
    n = pool.least
    taken = [pool.take(n) for _ in range(3)]  # no read expected: none kept
    addresses = [t.ctypes.data for t in taken]
    del taken
    gc.collect()
    assert not pool._idle
    pool.expect(4 * n)  # four reads of n bytes to come
    taken = [pool.take(n) for _ in range(3)]  # 1 read still expected
    addresses = [t.ctypes.data for t in taken]
    while taken:  # given back in the order taken
        del taken[0]
        gc.collect()
    assert [len(m) for m in pool._idle] == [n]  # the newest kept, for the last read
    last = pool.take(n)
    assert last.ctypes.data == addresses[2] and pool._expected == 0
    del last
    gc.collect()
    assert not pool._idle  # the reads are done: nothing idle is held
    pool.expect(4 * n)
    big = pool.take(2 * n)
    where = big.ctypes.data
    del big
    gc.collect()
    assert [len(m) for m in pool._idle] == [2 * n]  # 2n bytes still expected
    small = pool.take(n)  # the 2n buffer serves it (at most twice the bytes)
    assert small.ctypes.data == where
    assert not pool._idle and pool._expected == n
    del small
    gc.collect()
    assert not pool._idle  # 2n bytes idle > the n still expected: dropped
    pool.close()


def test_a_buffer_freed_inside_the_pools_locked_section_does_not_deadlock():
    """The cyclic collector may free a pool's array while this thread holds the
    pool's lock (`take` allocates in it): the give-back drops the buffer, never
    waits."""
    pool = _buffers.Pool()
    pool.expect(4 * pool.least)
    array = pool.take(pool.least)
    given = threading.Event()

    def free_while_locked():
        with pool._lock:  # what `take` holds when the collector runs
            nonlocal array
            del array  # the finalizer runs here, in this thread
            given.set()

    worker = threading.Thread(target=free_while_locked, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert given.is_set() and not worker.is_alive()
    assert not pool._idle  # dropped, not kept
    again = pool.take(pool.least)  # and the pool still works
    del again
    assert len(pool._idle) == 1
    pool.close()


def test_pool_buffers_are_not_advised_to_use_huge_pages():
    """Fresh transparent huge pages fault in slower than 4 KiB pages on the
    benchmarks' VM (see bridge/_buffers.py): a pool's buffer is not `MADV_HUGEPAGE`
    ("hg" in its mapping's VmFlags)."""
    smaps = "/proc/self/smaps"
    if not os.path.exists(smaps):
        pytest.skip("no /proc/self/smaps (not Linux)")
    pool = _buffers.Pool()
    buffer = pool.take(8 << 20)
    start = buffer.ctypes.data
    flags = None
    with open(smaps) as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            low, high = (int(x, 16) for x in head.split("-"))
            if low <= start < high:
                flags = next(
                    x for x in lines[i + 1 :] if x.startswith("VmFlags:")
                ).split()[1:]
                break
    assert flags is not None, "the buffer's mapping is not in /proc/self/smaps"
    assert "hg" not in flags
    pool.close()


def test_a_lazily_read_checkpoint_expects_its_arrays_in_its_pool(tmp_path):
    """Every array of at least `Pool.least` bytes, once (the reads the pool's idle
    buffers may serve); smaller ones take no pool buffer."""
    least = _buffers.Pool.least
    arrays = {
        "a": np.zeros(least // 4, np.float32),
        "b": np.zeros(least // 2 + 3, np.float32),
        "c": np.zeros(7, np.float32),
    }
    index = write_sharded(tmp_path, arrays, per_shard=2)
    with open_checkpoint(index) as contents:
        _sharded.FORMAT.lazy(contents)
        pool = contents.source.files.pool
        assert pool._expected == arrays["a"].nbytes + arrays["b"].nbytes


# --- reading ahead while converting (bridge/_lazy.py ReadAhead) -----------------------


def test_reads_ahead_stay_under_the_budget_and_unused_ones_are_dropped():
    threads = {}

    def array(i: int, size: int = 100, plain: bool = True) -> LazyArray:
        def load():
            threads[i] = threading.current_thread().name
            if i == 6:
                raise OSError("disk gone")
            return np.full(size, i, np.float32)

        return LazyArray((size,), np.float32, 0, load, plain=plain)

    arrays = [array(0), array(1), array(2), array(3, plain=False), array(4)]
    arrays += [array(5, size=1000), array(6), array(7)]
    budget = 800  # bytes: two arrays of 100 float32

    def ahead_bytes(i: int) -> int:
        return sum(a.nbytes for a in arrays[i + 1 :] if a._ahead is not None)

    with ReadAhead([[a] for a in arrays], budget) as ahead:
        ahead.reached(0)
        assert [a._ahead is not None for a in arrays] == [0, 1, 1, 0, 0, 0, 0, 0]
        np.testing.assert_array_equal(arrays[0].read(), np.zeros(100))
        assert threads[0] == threading.current_thread().name  # not read ahead
        ahead.reached(1)
        np.testing.assert_array_equal(arrays[1].read(), np.ones(100))
        assert threads[1].startswith("bridge-read-ahead")
        assert ahead_bytes(1) <= budget
        ahead.reached(2)  # row 2 passes without reading its array: dropped
        assert ahead_bytes(2) <= budget and arrays[4]._ahead is not None
        ahead.reached(3)
        assert arrays[2]._ahead is None
        arrays[3].read()  # not plain: never read in the thread
        assert threads[3] == threading.current_thread().name
        for i in (4, 5):
            ahead.reached(i)
            assert ahead_bytes(i) <= budget
            arrays[i].read()
        assert threads[4].startswith("bridge-read-ahead")
        assert threads[5] == threading.current_thread().name  # over the budget
        ahead.reached(6)
        with pytest.raises(OSError, match="disk gone"):  # raised where it is used
            arrays[6].read()
        assert threads[6].startswith("bridge-read-ahead")
    assert all(a._ahead is None for a in arrays)  # nothing held after the block
    assert threads[7].startswith("bridge-read-ahead")  # read ahead, never used


def test_early_reads_take_the_first_shards_under_the_budget_and_drop_the_unused():
    """`read_early` (`bridge.load` reads while it plans): plain arrays in reading
    order (by shard, then as given) in a thread, up to the budget (at least one
    array); a use takes the read made (an error raised there), nothing is held
    after."""
    threads: dict[int, str] = {}

    def array(i: int, order: int, size: int = 100, plain: bool = True) -> LazyArray:
        def load():
            threads.setdefault(i, threading.current_thread().name)
            if i == 2:
                raise OSError("disk gone")
            return np.full(size, i, np.float32)

        return LazyArray((size,), np.float32, order, load, plain=plain)

    arrays = [array(0, 2), array(1, 0, size=1000), array(2, 1)]
    arrays += [array(3, 0, plain=False), array(4, 1), array(5, 2), array(6, 3)]
    with read_early([*arrays, "not an array"], budget=5200):  # 1000 + 3 x 100 floats
        assert [a._ahead is not None for a in arrays] == [1, 1, 1, 0, 1, 0, 0]
        np.testing.assert_array_equal(arrays[1].read(), np.ones(1000))
        with pytest.raises(OSError, match="disk gone"):  # raised where it is used
            arrays[2].read()
        np.testing.assert_array_equal(arrays[5].read(), np.full(100, 5))
    assert all(a._ahead is None for a in arrays)  # nothing held after the block
    early = {i for i, t in threads.items() if t.startswith("bridge-read-early")}
    assert early == {0, 1, 2, 4}  # 0 and 4 read, never used; 3 not plain
    with read_early([array(7, 0, size=10**4)], budget=1):
        pass
    assert threads[7].startswith("bridge-read-early")  # one array, over the budget


@requires("NNX")
@pytest.mark.parametrize("ahead", [1, 10**9])  # everything read ahead, nothing
def test_a_port_reading_ahead_fills_the_same_bits(tmp_path, monkeypatch, ahead):
    """A Hugging Face folder (PyTorch layout, several shards) into an NNX model: the
    arrays read ahead in a thread (or none) are the model's, bit for bit."""
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, seed):
            rngs = nnx.Rngs(seed)
            self.up = nnx.Linear(5, 7, rngs=rngs)
            self.down = nnx.Linear(7, 3, rngs=rngs)
            self.norm = nnx.LayerNorm(3, rngs=rngs)

    source = MLP(0)
    bridge.save_pretrained(tmp_path, source, max_shard_size=150)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    monkeypatch.setattr(_run, "AHEAD", ahead)
    threads = []
    read_one = _safetensors.read_one

    def recorded(contents, name):
        threads.append(threading.current_thread().name)
        return read_one(contents, name)

    monkeypatch.setattr(_safetensors, "read_one", recorded)
    copies = []
    to_jax = _buffers.to_jax

    def copied(x):
        copies.append(threading.current_thread().name)
        return to_jax(x)

    monkeypatch.setattr(_buffers, "to_jax", copied)
    loaded = bridge.load(tmp_path, like=nnx.eval_shape(lambda: MLP(1)))
    in_thread = sum(t.startswith("bridge-read-ahead") for t in threads)
    assert (in_thread > 0) == (ahead == 1) and len(threads) == 6  # each read once
    # the first shard read while the port was planned, taken by the port's rows
    assert threads[0].startswith("bridge-read-early")
    # the two kernels transposed by XLA's copy in a thread, the rest kept as read
    assert sum(t.startswith("bridge-place") for t in copies) == 2
    for a, b in zip(
        jax.tree.leaves(nnx.state(loaded)), jax.tree.leaves(nnx.state(source))
    ):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@requires("NNX")
def test_an_early_read_no_row_uses_is_dropped_when_the_port_starts(
    tmp_path, monkeypatch
):
    """`bridge.load` reads while it plans (here the whole file); an array the plan
    leaves out (`strict=False`: a layer `like` lacks) is not held while the model
    is filled."""
    from flax import nnx

    class Two(nnx.Module):
        def __init__(self, seed, extra):
            rngs = nnx.Rngs(seed)
            self.up = nnx.Linear(5, 7, rngs=rngs)
            if extra:
                self.head = nnx.Linear(7, 2, rngs=rngs)

    source = Two(0, extra=True)
    bridge.save_pretrained(tmp_path, source)
    monkeypatch.setattr(_checkpoint, "EARLY", 1)  # the whole file read early
    held = {}
    read_ahead = _run._read_ahead

    def seen(steps, source_tree):
        ahead = read_ahead(steps, source_tree)
        for path, leaf in jax.tree_util.tree_leaves_with_path(source_tree):
            held[jax.tree_util.keystr(path)] = leaf._ahead is not None
        return ahead

    monkeypatch.setattr(_run, "_read_ahead", seen)
    like = nnx.eval_shape(lambda: Two(1, extra=False))
    loaded = bridge.load(tmp_path, like=like, strict=False)  # logs `.head` unused
    assert held and not any(v for k, v in held.items() if "head" in k)
    assert any(v for k, v in held.items() if "up" in k)  # read early, kept for use
    assert np.asarray(loaded.up.kernel[...]).tobytes() == (
        np.asarray(source.up.kernel[...]).tobytes()
    )


@requires("NNX")
def test_a_load_under_another_default_device_copies_in_this_thread(tmp_path):
    """JAX's settings are per thread: under `jax.default_device(...)` every array
    is placed by the caller's thread, on that device (a thread would place them on
    the first device)."""
    from flax import nnx

    source = nnx.Linear(6, 5, rngs=nnx.Rngs(0))
    bridge.save_pretrained(tmp_path, source)
    other = jax.devices("cpu")[1]
    with jax.default_device(other):
        like = nnx.eval_shape(lambda: nnx.Linear(6, 5, rngs=nnx.Rngs(1)))
        loaded = bridge.load(tmp_path, like=like)
    for leaf in jax.tree.leaves(nnx.state(loaded)):
        assert leaf.devices() == {other}
    assert (
        np.asarray(loaded.kernel[...]).tobytes()
        == np.asarray(source.kernel[...]).tobytes()
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8"])
def test_layout_copies_in_threads_are_numpy_transposes_bit_for_bit(dtype):
    """`Placing`: transposed views (odd shapes, one row, one column) become JAX
    arrays equal bit for bit to numpy's transpose, at most `budget` bytes waiting
    (or one array), each error raised where its array is asked for."""
    rng = np.random.default_rng(0)
    shapes = [(7, 13), (1, 9), (9, 1), (300, 257), (33, 1000)]
    arrays = [(rng.standard_normal(s) * 50).astype(dtype) for s in shapes]
    budget = 3 * arrays[-1].nbytes // 2
    with _buffers.Placing(budget) as placing:
        kept = placing.put(np.ascontiguousarray(arrays[0]))  # no layout change: now
        assert isinstance(kept, jax.Array) and placing._threads is None
        placed = []
        for x in arrays:
            placed.append(placing.put(x.T))
            assert placing._threads
            sizes = [n for _, n in placing._waiting]
            # at most the budget, not counting one copy larger than it
            larger = [n for n in sizes if n > budget]
            assert len(larger) <= 1 and sum(sizes) - sum(larger) <= budget
        broken = placing.put(np.zeros((4, 5), np.dtype("V2")).T)  # JAX refuses it
        with pytest.raises(TypeError):
            placing.result(broken)
    for x, out in zip(arrays, placed, strict=True):
        out = placing.result(out)
        assert out.dtype == x.dtype and out.shape == x.T.shape
        assert np.asarray(out).tobytes() == np.ascontiguousarray(x.T).tobytes()


def test_a_large_copy_under_way_does_not_hold_up_the_ones_within_the_budget(
    monkeypatch,
):
    """`Placing`: beside a single copy larger than the budget (a 64 MiB `lm_head`)
    the others go on within the budget; one over it waits for the first copy to
    end, not for the large one."""
    release = threading.Event()
    to_jax = _buffers.to_jax

    def slow(x):
        if x.size > 1000:
            assert release.wait(10)
        return to_jax(x)

    monkeypatch.setattr(_buffers, "to_jax", slow)
    rng = np.random.default_rng(0)
    large = rng.standard_normal((100, 20), np.float32)
    smalls = [rng.standard_normal((10, 5), np.float32) for _ in range(3)]
    with _buffers.Placing(budget=2 * smalls[0].nbytes) as placing:
        first = placing.put(large.T)
        assert placing._threads
        others = [placing.put(x.T) for x in smalls]  # none waited for the large one
        assert not first.done() and others[0].done()
        assert sum(n for _, n in placing._waiting) <= large.nbytes + placing._budget
        release.set()
    for out, x in zip([first, *others], [large, *smalls], strict=True):
        assert np.asarray(placing.result(out)).tobytes() == x.T.tobytes()


def test_copies_of_memory_held_anyway_wait_outside_the_budget(monkeypatch):
    """`Placing.put(x, held=True)`: a view of memory the source holds anyway (a
    PyTorch module's weights) frees nothing when copied, so its copy never waits
    for a budget (of 0 here: a port from memory reads nothing lazily), where a
    copy of memory of its own (a converted array) waits for the one under way."""
    release = threading.Event()
    to_jax = _buffers.to_jax

    def slow(x):
        assert release.wait(10)
        return to_jax(x)

    monkeypatch.setattr(_buffers, "to_jax", slow)
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((30, 20), np.float32) for _ in range(4)]
    with _buffers.Placing(budget=0) as placing:
        views = [placing.put(w.T, held=True) for w in weights]  # none waited
        assert not any(v.done() for v in views) and len(placing._waiting) == 4
        own = threading.Thread(target=lambda: views.append(placing.put(weights[0].T)))
        own.start()
        own.join(0.2)
        assert own.is_alive()  # a copy of memory of its own waits for the others
        release.set()
        own.join(10)
    for out, w in zip(views, [*weights, weights[0]], strict=True):
        assert np.asarray(placing.result(out)).tobytes() == w.T.tobytes()


# --- the cyclic garbage collector during a load --------------------------------------


def test_a_load_pauses_the_collector_and_restores_the_callers_state(
    tmp_path, monkeypatch
):
    path = tmp_path / "w.safetensors"
    safetensors.numpy.save_file(values(2), path)
    during = []
    real = _safetensors.read_many

    def seen(contents, names):
        during.append(gc.isenabled())
        yield from real(contents, names)

    monkeypatch.setattr(_safetensors, "read_many", seen)
    missing = tmp_path / "missing.safetensors"
    check_collector_paused(
        lambda: bridge.load(path),
        during,
        lambda: bridge.load(missing),
        bridge.CheckpointError,
    )
