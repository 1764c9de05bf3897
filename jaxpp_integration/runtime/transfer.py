"""Moving values between groups that live on different processes (multi-controller JAX).

Single process: the executor copies shards to the target group itself (`jax_compat.copy_shards`).
Several processes: a transfer is an XLA collective both processes run (gloo on CPU, NCCL on
GPU), in program order, so the collectives match.

Design (what one transfer costs):

- **Batches.** Consecutive transfers between one (source group, target group) pair on different
  processes — only deletes between them, no task — are one *batch*, moved by one compiled program
  (`plan_cross_process`; the rule reads the program and which process owns each group, so every
  process cuts the same batches). A stage sending its hidden state and its tokens is one batch;
  so are the per-leaf norm partials a group sends the others in the optimizer phase (42 in all
  in the trainer's default step at pp=2).
- **The pair program.** The two groups' meshes are stacked along the pipeline axis into a
  2-group mesh. A value of shape (n0, n1, ...) with spec (e0, e1, ...) inside a group is half of
  a (2·n0, n1, ...) array split over (pipeline axis, *e0) on dim 0: every device's block is
  exactly the block it holds of the value, so the sender's shards enter the program as they
  are (no copy, no launch) and the receiver's output shards are the received value. The program
  is one `ppermute` 0 → 1 per entry.
- **Scalars as one vector.** Scalars (shape ()) have no dimension to stack along: the sender
  packs a batch's scalars into one vector per dtype (one small program), the vector crosses as
  above, the receiver unpacks it (one small program). Bitwise: only copies.
- **Receive buffers on the device.** The receiver must feed the pair program its half of every
  input, which the program never reads. Those buffers are zeros made on the device by a
  compiled program, once per leaf signature when the step is compiled, and reused by every
  step (read-only: never donated). No host array is placed on a device on this path.

- **One device order per stage boundary.** The pair's mesh lists the two groups in one order
  whichever way a value goes (`_pair_order`), so both directions of a boundary (activations
  forward, cotangents back) run over one device list: one NCCL communicator per pair, not two.

Launches per batch and step: sender 1 (+1 pack if the batch holds scalars), receiver 1 (+1
unpack); none at all for buffers. Memory: the receiver keeps one zeros buffer per distinct
(shape, dtype, layout) it receives. The sender keeps nothing payload-sized: an SPMD program has
an output block on every device, so its half of the moved values (zeros) exists while the
program runs, but the sender drops it at dispatch and waits (watchdog) on a 4-byte flag.

What this design costs, and what would not: every transfer is a collective both groups run on
their compute streams, so a send waits for the receiver to reach it and holds the sender's
stream meanwhile (`schedules/simulate.py`, `transfers="blocking"`;
`benchmarks/transfer_bubble.py` shows the bubble per schedule at 8 stages across nodes). The
alternatives and why they are not used yet are in docs/cluster.md ("Stage transfers across
processes").


`SpecExchange` carries the output layouts of programs compiled on one process to the others
(through `jax.distributed`'s key-value store), so that each process compiles only its own
groups' programs (see `compiler/compile.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpp_integration.compiler.program import Delete, Transfer
from jaxpp_integration.jax_compat import kv_get, kv_set, shard_map

# ----------------------------------------------------------------------------- layouts exchange


class SpecExchange:
    """Publishes the output specs of the programs this process compiles and fetches those of
    programs other processes compile, under one key per program instruction in `namespace`
    (unique per compile, the same on every process). A fetch waits until the owner publishes."""

    def __init__(self, namespace: str, timeout_s: float):
        self.namespace, self.timeout_s = namespace, timeout_s

    def publish(self, index: int, specs) -> None:
        kv_set(f"{self.namespace}/{index}", json.dumps([_spec_json(s) for s in specs]))

    def fetch(self, index: int) -> list[PartitionSpec]:
        text = kv_get(f"{self.namespace}/{index}", self.timeout_s)
        return [
            PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in entries))
            for entries in json.loads(text)
        ]


def _spec_json(spec: PartitionSpec) -> list:
    assert not getattr(spec, "unreduced", None), spec  # task outputs are never unreduced
    return [list(e) if isinstance(e, tuple) else e for e in spec]


# ----------------------------------------------------------------------------- batches


@dataclasses.dataclass(frozen=True)
class Link:
    """One value crossing: its layout on the sending and on the receiving group."""

    src: NamedSharding
    dst: NamedSharding
    shape: tuple
    dtype: np.dtype


def cross_process_runs(prog, owners) -> list[tuple[int, list]]:
    """The batches of `prog`'s transfers between groups of different processes, as (index of
    the first transfer, the transfers), in program order: consecutive transfers between one
    (source group, target group) pair with only deletes between them, never a value relayed
    within a batch. `owners[r]` is the process holding group r; the rule reads nothing else, so
    every process cuts the same batches."""
    runs: list[tuple[int, list | None]] = []
    for idx, ins in enumerate(prog.instrs):
        if isinstance(ins, Delete):
            continue  # frees a slot no later transfer of the batch reads
        if isinstance(ins, Transfer) and owners[ins.src_rank] != owners[ins.dst_rank]:
            if runs and runs[-1][1] is not None:
                first = runs[-1][1][0]
                same_pair = (first.src_rank, first.dst_rank) == (ins.src_rank, ins.dst_rank)
                relayed = any(t.dst == ins.src for t in runs[-1][1])
                if same_pair and not relayed:
                    runs[-1][1].append(ins)
                    continue
            runs.append((idx, [ins]))
        else:
            runs.append((idx, None))  # anything else ends a batch
    return [(idx, transfers) for idx, transfers in runs if transfers is not None]


def plan_cross_process(prog, slot_sharding, owners, local_ranks, axis: str) -> dict:
    """{index of a batch's first transfer: (its transfers, `CrossBatch`)} for the batches
    (`cross_process_runs`) this process takes part in."""
    runs = cross_process_runs(prog, owners)
    cache: dict = {}  # receive buffers, shared by the batches of this program
    out = {}
    for idx, transfers in runs:
        sending = transfers[0].src_rank in local_ranks
        if not sending and transfers[0].dst_rank not in local_ranks:
            continue
        links = [
            Link(
                slot_sharding[t.src],
                slot_sharding[t.dst],
                tuple(prog.slot_aval[t.dst].shape),
                np.dtype(prog.slot_aval[t.dst].dtype),
            )
            for t in transfers
        ]
        out[idx] = (transfers, CrossBatch(links, sending, axis, cache))
    return out


class CrossBatch:
    """Moves a batch of values from one group to a group of another process (see the module
    docstring). Built once per program (compiles its programs, allocates receive buffers);
    called once per step on both processes, in the same order."""

    def __init__(self, links: list[Link], sending: bool, axis: str, buffers: dict | None = None):
        self.links, self.sending = links, sending
        self.arrays = [i for i, lk in enumerate(links) if lk.shape]
        dtypes = list(dict.fromkeys(lk.dtype for lk in links if not lk.shape))
        self.scalars = [
            [i for i, lk in enumerate(links) if not lk.shape and lk.dtype == dt] for dt in dtypes
        ]
        first = links[0]
        src_mesh, dst_mesh = first.src.mesh, first.dst.mesh
        entries = [(lk.shape, lk.dtype, lk.src.spec) for lk in (links[i] for i in self.arrays)]
        entries += [((len(group),), dt, PartitionSpec()) for group, dt in zip(self.scalars, dtypes)]
        self.pair, self.pair_shardings = _pair_program(
            *_pair_order(src_mesh, dst_mesh), axis, tuple(entries), _first_sends(src_mesh, dst_mesh)
        )
        here_mesh = src_mesh if sending else dst_mesh
        vectors = [NamedSharding(here_mesh, PartitionSpec()) for _ in dtypes]
        self.pack = self.unpack = None
        if self.scalars and sending:
            ins = tuple((links[i].src, links[i].dtype) for group in self.scalars for i in group)
            self.pack = _pack_program(ins, tuple(len(g) for g in self.scalars), tuple(vectors))
        if self.scalars and not sending:
            outs = tuple((links[i].dst, links[i].dtype) for group in self.scalars for i in group)
            self.unpack = _unpack_program(
                tuple((len(g), dt) for g, dt in zip(self.scalars, dtypes)), tuple(vectors), outs
            )
        self.buffers = []
        if not sending:  # the receiver's (unread) half of every input, made once on the device
            buffers = {} if buffers is None else buffers
            here = [(links[i].shape, links[i].dtype, links[i].dst) for i in self.arrays]
            here += [((len(g),), dt, v) for g, dt, v in zip(self.scalars, dtypes, vectors)]
            for shape, dtype, sharding in here:
                key = (shape, dtype, sharding)
                if key not in buffers:
                    buffers[key] = _zeros_program(shape, dtype, sharding)()
                self.buffers.append(buffers[key])

    def __call__(self, values):
        """`values`: the sent arrays on the sender, ignored on the receiver. Returns (the
        received arrays or None on the sender, the collective's output for a watchdog)."""
        if self.sending:
            halves = [values[i] for i in self.arrays]
            if self.pack is not None:
                halves += list(self.pack(*[values[i] for g in self.scalars for i in g]))
        else:
            halves = self.buffers
        stacked = [
            jax.make_array_from_single_device_arrays(
                sh.shape_for(h), sh.sharding, [s.data for s in h.addressable_shards]
            )
            for h, sh in zip(halves, self.pair_shardings)
        ]
        *moved, done = self.pair(*stacked)
        if self.sending:  # its half of `moved` is zeros: dropped now, freed when the program ends
            return None, done
        got = [
            _local_half(m, self.links[i].dst, self.links[i].shape)
            for i, m in zip(self.arrays, moved)
        ]
        received: list = [None] * len(self.links)
        for i, g in zip(self.arrays, got):
            received[i] = g
        if self.unpack is not None:
            vectors = [
                _local_half(m, NamedSharding(self.links[0].dst.mesh, PartitionSpec()), (len(g),))
                for m, g in zip(moved[len(self.arrays) :], self.scalars)
            ]
            for i, v in zip([i for g in self.scalars for i in g], self.unpack(*vectors)):
                received[i] = v
        return received, moved


def _local_half(moved: jax.Array, sharding: NamedSharding, shape) -> jax.Array:
    """This process's blocks of a pair program's output, as the value on its own group."""
    return jax.make_array_from_single_device_arrays(
        tuple(shape), sharding, [s.data for s in moved.addressable_shards]
    )


def _pair_spec(axis: str, spec: PartitionSpec) -> PartitionSpec:
    head = spec[0] if len(spec) else None
    head = () if head is None else head if isinstance(head, tuple) else (head,)
    return PartitionSpec((axis, *head), *spec[1:])


def _pair_order(a: Mesh, b: Mesh) -> tuple[Mesh, Mesh]:
    """The two groups' meshes in one order whichever way a value goes (the group whose first
    device has the lower id first): both directions of a stage boundary then run over one
    device list, so NCCL uses one communicator for the pair instead of one per direction."""
    return (a, b) if _first_id(a) < _first_id(b) else (b, a)


def _first_sends(src: Mesh, dst: Mesh) -> bool:
    """Whether the sending group comes first in `_pair_order`."""
    return _first_id(src) < _first_id(dst)


def _first_id(mesh: Mesh) -> int:
    return min(d.id for d in mesh.devices.flat)


@functools.cache
def _pair_program(first: Mesh, second: Mesh, axis: str, entries: tuple, first_sends: bool):
    """(compiled program, per-input sharding) moving every entry (shape, dtype, spec within a
    group) between the groups of `first` and `second` (in that order on the pair's mesh) with
    one `ppermute` each: from `first` to `second` when `first_sends`, else back. Its last
    output is a 4-byte flag per device, ready once every move is done (what a sender waits on:
    its half of the moved values is zeros it drops at once)."""
    axis_index = first.axis_names.index(axis)
    devices = np.concatenate([first.devices, second.devices], axis=axis_index)
    mesh = Mesh(devices, first.axis_names, axis_types=first.axis_types)
    specs = tuple(_pair_spec(axis, spec) for _, _, spec in entries)
    perm = [(0, 1)] if first_sends else [(1, 0)]

    def move(*blocks):
        moved = tuple(jax.lax.ppermute(b, axis, perm) for b in blocks)
        return jax.lax.optimization_barrier((*moved, jnp.zeros((1,), jnp.int32)))

    flag = PartitionSpec(axis)
    body = shard_map(move, mesh=mesh, in_specs=specs, out_specs=(*specs, flag), check=False)
    shardings = [NamedSharding(mesh, s) for s in specs]
    avals = [
        jax.ShapeDtypeStruct((2 * shape[0], *shape[1:]), dtype, sharding=sh)
        for (shape, dtype, _), sh in zip(entries, shardings)
    ]
    compiled = jax.jit(body).lower(*avals).compile()
    return compiled, [_StackedSharding(sh) for sh in shardings]


class _StackedSharding:
    """A pair input's sharding plus the global shape a half of it (one group's value) makes."""

    def __init__(self, sharding: NamedSharding):
        self.sharding = sharding

    def shape_for(self, half) -> tuple:
        return (2 * half.shape[0], *half.shape[1:])


@functools.cache
def _pack_program(ins: tuple, sizes: tuple, vectors: tuple):
    """Scalars (sharding, dtype per input, grouped by dtype in `sizes`) -> one vector per dtype."""

    def pack(*xs):
        out, k = [], 0
        for n in sizes:
            out.append(jnp.stack(xs[k : k + n]))
            k += n
        return tuple(out)

    avals = [jax.ShapeDtypeStruct((), dt, sharding=sh) for sh, dt in ins]
    return jax.jit(pack, out_shardings=vectors).lower(*avals).compile()


@functools.cache
def _unpack_program(groups: tuple, vectors: tuple, outs: tuple):
    """One vector per dtype -> its scalars, each with its target sharding."""

    def unpack(*vs):
        return tuple(v[i] for v, (n, _) in zip(vs, groups) for i in range(n))

    avals = [jax.ShapeDtypeStruct((n,), dt, sharding=sh) for (n, dt), sh in zip(groups, vectors)]
    return jax.jit(unpack, out_shardings=tuple(sh for sh, _ in outs)).lower(*avals).compile()


@functools.cache
def _zeros_program(shape: tuple, dtype, sharding: NamedSharding):
    """A compiled program making zeros of `shape` on `sharding`'s devices (no host data)."""

    def receive_buffer():
        return jnp.zeros(shape, dtype)

    return jax.jit(receive_buffer, out_shardings=sharding).lower().compile()
