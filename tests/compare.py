"""How tests compare results: bit patterns for "bitwise", per-leaf scaled tolerances otherwise,
and where arrays live. Every equivalence test uses these so that "bitwise" always means equal bit
patterns (-0.0 differs from +0.0, NaN payloads count) and a tolerance never borrows its scale from
another leaf.

Tolerances are reasoned, never measured: XLA:CPU emits different code per CPU instruction set,
so a bound read off one machine fails on another. Where two programs compute the same values with
their float32 sums in another order (another fusion, a sharded reduction, microbatch partials),
the bound is Higham's for a reordered sum (`reordered_sum_rtol`): a sum of n terms evaluated in
any order is within (n-1)u of the sum of its terms' magnitudes (u = 2^-24 = EPS32 / 2; Higham,
"Accuracy and Stability of Numerical Algorithms", 2nd ed., section 4.2), so two orders are within
(n-1) EPS32 of each other, taken relative to each leaf's largest magnitude; doubled for leaves
holding squares of such sums (Adam's `nu`). Such differences grow step after step through the
optimizer (measured here: a `nu` 17 EPS32 apart after 2 Adam steps, 134 after 3, where one step
from the same state moves 4), so trainers are compared one step at a time from the same input
state (`put_like`), and a bound covers one step's sums.

Python and numpy float64 arithmetic (the planner, the simulator, cost formulas) does not depend
on XLA or the CPU: where such a result is compared with its formula evaluated in another order,
`pytest.approx`'s default (1e-6 relative) or a stated 1e-9..1e-12 sits far above float64's
rounding (~1e-16 per operation).
"""

from __future__ import annotations

import jax
import numpy as np

EPS32 = float(np.finfo(np.float32).eps)  # 2^-23: the float32 ulp at 1.0


def reordered_sum_rtol(terms: int, squared: bool = True) -> float:
    """The per-leaf bound for values made by sums of `terms` terms that two programs add in
    different orders: (terms - 1) EPS32 (see the module docstring), twice that when the leaves
    include squares of the sums (`squared`: an optimizer state with Adam's `nu`)."""
    return (2 if squared else 1) * (terms - 1) * EPS32


def _host(x):
    return np.asarray(x)


def host(tree):
    """Every leaf as a numpy array (an `MpmdArray` from its first group)."""
    return jax.tree.map(np.asarray, tree)


def put_like(template, tree):
    """`tree` (numpy leaves) placed as `template`'s leaves are: a `jax.Array` onto its sharding,
    an `MpmdArray` onto each group holding it (so that two compiled steps can start from the
    same state, each in its own layout)."""
    from jaxpp_integration import MpmdArray

    def put(t, x):
        if isinstance(t, MpmdArray):
            arrays = {g: jax.device_put(x, a.sharding) for g, a in t.arrays.items()}
            return MpmdArray(t.mpmd_mesh, arrays, mpmd_idxs=t.mpmd_idxs)
        return jax.device_put(x, t.sharding)

    return jax.tree.map(put, template, tree)


def bits(x) -> np.ndarray:
    """The raw bit pattern of an array (as unsigned ints of the same width)."""
    a = _host(x)
    a = np.ascontiguousarray(a).reshape(a.shape)  # ascontiguousarray makes a scalar 1-d
    if a.dtype == np.bool_:
        return a.view(np.uint8)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _paths(tree):
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def assert_bitwise(ref, got, what: str = ""):
    """Every leaf of `got` has the same shape, dtype and bit pattern as `ref`'s."""
    ref_leaves, ref_def = jax.tree.flatten(ref)
    got_leaves, got_def = jax.tree.flatten(got)
    assert ref_def == got_def, f"{what}: tree structures differ: {ref_def} vs {got_def}"
    for path, x, y in zip(_paths(ref), ref_leaves, got_leaves, strict=True):
        x, y = _host(x), _host(y)
        assert x.shape == y.shape, f"{what}{path}: shape {y.shape} != {x.shape}"
        assert x.dtype == y.dtype, f"{what}{path}: dtype {y.dtype} != {x.dtype}"
        differ = bits(x) != bits(y)
        if differ.any():
            first = np.argwhere(differ)[0]
            raise AssertionError(
                f"{what}{path}: {int(differ.sum())} of {x.size} elements differ bitwise; "
                f"first at {tuple(first)}: {y[tuple(first)]!r} != {x[tuple(first)]!r}"
            )


def assert_close_per_leaf(ref, got, rtol: float, what: str = "", floor: float = 0.0):
    """|got - ref| <= rtol * max|ref leaf| (+ floor) for every float leaf, each leaf scaled by
    itself; integer and bool leaves must be equal. A leaf that is all zeros in `ref` must be
    all zeros (within `floor`) in `got`, so a vanishing leaf cannot hide behind a big one."""
    ref_leaves, ref_def = jax.tree.flatten(ref)
    got_leaves, got_def = jax.tree.flatten(got)
    assert ref_def == got_def, f"{what}: tree structures differ: {ref_def} vs {got_def}"
    for path, x, y in zip(_paths(ref), ref_leaves, got_leaves, strict=True):
        x, y = _host(x), _host(y)
        assert x.shape == y.shape, f"{what}{path}: shape {y.shape} != {x.shape}"
        if not np.issubdtype(x.dtype, np.floating) and x.dtype.kind != "V":
            np.testing.assert_array_equal(y, x, err_msg=f"{what}{path}")
            continue
        x64, y64 = x.astype(np.float64), y.astype(np.float64)
        assert np.isfinite(x64).all(), f"{what}{path}: reference has non-finite values"
        scale = float(np.max(np.abs(x64))) if x64.size else 0.0
        err = float(np.max(np.abs(y64 - x64))) if x64.size else 0.0
        bound = rtol * scale + floor
        assert err <= bound, (
            f"{what}{path}: max |diff| {err:.3e} > {bound:.3e} (rtol {rtol:g} x leaf scale "
            f"{scale:.3e})"
        )


def ulps(ref, got) -> int:
    """The largest distance in units of last place between two float arrays."""
    x, y = _host(ref), _host(got)
    ints = {2: np.int16, 4: np.int32, 8: np.int64}[x.dtype.itemsize]
    xi = x.view(ints).astype(np.int64)
    yi = y.view(ints).astype(np.int64)
    # map sign-magnitude to a monotone integer line
    big = np.int64(1) << (8 * x.dtype.itemsize - 1)
    xi = np.where(xi < 0, -(xi & (big - 1)), xi)
    yi = np.where(yi < 0, -(yi & (big - 1)), yi)
    return int(np.max(np.abs(xi - yi))) if x.size else 0


def group_devices(mpmd_mesh, group: int) -> set:
    """The devices of one pipeline group."""
    return set(mpmd_mesh.unstack[group].devices.flat)


def assert_on_group(mpmd_array, mpmd_mesh, groups):
    """An `MpmdArray` is held exactly by `groups`, and each of its per-group arrays sits on that
    group's devices (not merely reports the right group index): its sharding's device set and
    the devices of the buffers it actually holds are both that group's."""
    groups = tuple(groups)
    assert tuple(mpmd_array.mpmd_idxs) == groups, f"held by {mpmd_array.mpmd_idxs}, want {groups}"
    local = mpmd_array.arrays  # only this process's groups
    assert local, "no group of this array is held by this process"
    assert set(local) <= set(groups), f"holds arrays for groups {sorted(local)}, want {groups}"
    for g, arr in local.items():
        want = group_devices(mpmd_mesh, g)
        ids = lambda devices: sorted(d.id for d in devices)
        assert set(arr.sharding.device_set) == want, (
            f"group {g}'s array is on {ids(arr.sharding.device_set)}, want {ids(want)}"
        )
        held = {d for shard in arr.addressable_shards for d in shard.data.devices()}
        assert held == want, f"group {g}'s buffers are on {ids(held)}, want {ids(want)}"
