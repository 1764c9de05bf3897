"""How tests compare results: bit patterns for "bitwise", per-leaf scaled tolerances otherwise,
and where arrays live. Every equivalence test uses these so that "bitwise" always means equal bit
patterns (-0.0 differs from +0.0, NaN payloads count) and a tolerance never borrows its scale from
another leaf."""

from __future__ import annotations

import jax
import numpy as np


def _host(x):
    return np.asarray(x)


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
