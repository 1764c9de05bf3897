"""Reading pipelined values on the host: `fetch(tree)` now, `fetch_later(tree)` started now and
read later. Every process gets numpy copies of the same values.

On one host an `MpmdArray` is read from any group that holds it: no device work. Under
multi-controller JAX each value is read where it lives, the first group holding it (its
"source" process), and travels to the other processes. `fetch_later` does that without a host
round trip and without waiting for anything:

1. on each process, one small program per group it reads values from packs them into one
   vector of 32-bit words (a value's bits: float32 and int32 values are bit-cast, narrower
   types widened exactly first), on that group's devices;
2. one collective over one device per process (an all-gather of a (processes, words) array)
   gives every process every vector.

Both are dispatched when `fetch_later` is called and run once the values exist (on a device's
stream: after the step that makes them, before whatever is dispatched later); `.result()` waits
for them and unpacks. A training loop calls `fetch_later` on a step's metrics right after
dispatching the step, and reads the result after dispatching the next one: the next step is
never held up, and the values of many steps can travel in one collective (the trainer batches a
log period's: `MaxText/train.py`). Bitwise: only copies and bit-casts. Every process must call
it on the same tree in the same order (it is a collective), and read the results in that order.

Leaves that are plain `jax.Array`s spanning several processes are gathered with
`multihost_utils.process_allgather` when read; numpy values pass through.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpp_integration.frontend.array import MpmdArray

WORD = np.uint32


def _source_group(a: MpmdArray) -> int:
    return a.mpmd_idxs[0]


def _process_of(a: MpmdArray) -> int:
    return next(iter(a.mpmd_mesh.devices_of(_source_group(a)))).process_index


def fetch(tree):
    """`tree` with every `MpmdArray` / `jax.Array` leaf replaced by a numpy array, on every
    process (waits for the values)."""
    return fetch_later(tree).result()


def fetch_later(tree) -> Fetch:
    """Starts reading `tree`'s values (see the module docstring); `.result()` returns them."""
    return Fetch(tree)


class Fetch:
    """A read of a tree's values, started; `result()` waits for it and returns numpy values."""

    def __init__(self, tree):
        self.leaves, self.treedef = jax.tree.flatten(tree)
        self.gathered = None
        if jax.process_count() > 1:
            self.gathered, self.layout = _start_exchange(self.leaves)

    def result(self):
        if self.gathered is None:
            return jax.tree.unflatten(self.treedef, [_read_local(x) for x in self.leaves])
        table = np.asarray(self.gathered.addressable_shards[0].data)  # (processes, words)
        out = []
        for x, where in zip(self.leaves, self.layout):
            if where is None:
                out.append(_read_other(x))
            else:
                process, start = where
                out.append(_unpack(table[process, start : start + _words(x)], x))
        return jax.tree.unflatten(self.treedef, out)


def _read_local(x):
    return np.asarray(x)


def _read_other(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


# ------------------------------------------------------------------------- several processes


def _words(x) -> int:
    return max(1, int(np.prod(x.shape)))


def _start_exchange(leaves):
    """Dispatches the packing programs and the all-gather; returns (the gathered array, per
    leaf (source process, first word) or None for leaves not exchanged this way)."""
    me = jax.process_index()
    layout: list = []
    used: dict[int, int] = {}  # process -> words it sends
    mine: dict[int, list[int]] = {}  # source group on this process -> leaf indices
    for i, x in enumerate(leaves):
        if not isinstance(x, MpmdArray):
            layout.append(None)
            continue
        process = _process_of(x)
        layout.append((process, used.get(process, 0)))
        used[process] = used.get(process, 0) + _words(x)
        if process == me:
            mine.setdefault(_source_group(x), []).append(i)
    processes = jax.process_count()
    width = max(used.values(), default=0)
    if width == 0:
        return None, layout
    devices = _one_device_per_process(leaves)
    vectors = []
    for group, idx in mine.items():
        whole = NamedSharding(leaves[idx[0]].mpmd_mesh.unstack[group], PartitionSpec())
        packed = _pack_program(len(idx), whole)
        vector = packed(*[leaves[i].arrays[group] for i in idx])
        vectors.append(jax.device_put(vector.addressable_shards[0].data, devices[me]))
    row = _row_program(tuple(v.shape[0] for v in vectors), width, devices[me])(*vectors)
    return _gather_program(tuple(devices), processes, width)(
        _global_rows(row, devices, width)
    ), layout


def _one_device_per_process(leaves) -> list:
    """The device each process's row lives on: the first device of the mesh the values belong
    to that the process owns (every process computes the same list)."""
    mesh = next(x.mpmd_mesh for x in leaves if isinstance(x, MpmdArray)).jax_mesh
    first: dict[int, object] = {}
    for d in mesh.devices.flat:
        first.setdefault(d.process_index, d)
    return [first[p] for p in range(jax.process_count())]


@functools.cache
def _pack_program(count: int, whole: NamedSharding):
    """`count` values of one group -> one vector of their 32-bit words, whole on each of the
    group's devices (`whole`: replicated over the group)."""

    def pack(*xs):
        return jnp.concatenate([_to_words(x).reshape(-1) for x in xs])

    return jax.jit(pack, out_shardings=whole)


def _to_words(x):
    if x.dtype.itemsize == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if jnp.issubdtype(x.dtype, jnp.floating):  # float16 / bfloat16: exact in float32
        return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    if x.dtype.itemsize < 4:  # bool and narrow integers: exact in int32
        return jax.lax.bitcast_convert_type(x.astype(jnp.int32), jnp.uint32)
    raise TypeError(f"fetch: {x.dtype} values cannot travel as 32-bit words; cast them first")


def _unpack(words: np.ndarray, x) -> np.ndarray:
    dtype = np.dtype(x.dtype)
    if dtype.itemsize == 4:
        value = words.view(dtype)
    elif np.issubdtype(dtype, np.floating) or dtype == np.dtype(jnp.bfloat16):
        value = words.view(np.float32).astype(dtype)
    else:
        value = words.view(np.int32).astype(dtype)
    return value.reshape(x.shape)


@functools.cache
def _row_program(sizes: tuple, width: int, device):
    """This process's vectors (on `device`) -> one (1, width) row, zero-padded."""

    def row(*vectors):
        flat = jnp.concatenate(vectors) if vectors else jnp.zeros((0,), WORD)
        return jnp.pad(flat, (0, width - flat.shape[0]))[None]

    return jax.jit(row, out_shardings=jax.sharding.SingleDeviceSharding(device))


def _global_rows(row, devices, width) -> jax.Array:
    mesh = Mesh(np.array(devices), ("processes",))
    sharding = NamedSharding(mesh, PartitionSpec("processes"))
    return jax.make_array_from_single_device_arrays((len(devices), width), sharding, [row])


@functools.cache
def _gather_program(devices: tuple, processes: int, width: int):
    """The (processes, width) rows, one per process, -> the whole table on every process."""
    mesh = Mesh(np.array(devices), ("processes",))
    return jax.jit(lambda rows: rows, out_shardings=NamedSharding(mesh, PartitionSpec()))
