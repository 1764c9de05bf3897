"""`treduce`: the microbatch loop that the engine pipelines.

`treduce(fn, xs, schedule)` calls `fn` on each microbatch `xs[i]` (leaves sliced along `axis`)
and folds the outputs with `Add` / `Concat` / `Max`. It binds the `treduce` primitive, which
carries the loop body as a closed jaxpr whose invars are (loop constants..., microbatch leaves...).
The primitive's impl and lowering are an ordinary `fori_loop`, so under plain `jax.jit` treduce is
the reference every pipelined result must equal. Under `mpmd_jit_with_loop` the body is traced
with stage markers active and the engine partitions the bound equation instead of lowering it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, Primitive, jaxpr_as_fun
from jax.interpreters import mlir

from jaxpp_integration.frontend import marker
from jaxpp_integration.frontend.reductions import Add, Concat, broadcast_operations

treduce_p = Primitive("treduce")
treduce_p.multiple_results = True

_PIPELINED: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxpp_pipelined", default=False)


@contextlib.contextmanager
def pipelined_tracing():
    """Set by `mpmd_jit_with_loop` while it traces the step: treduce bodies get stage markers."""
    token = _PIPELINED.set(True)
    try:
        yield
    finally:
        _PIPELINED.reset(token)


def treduce(fn, xs, schedule=None, axis: int = 0, operation=(Concat(), Add), out_specs=None):
    """Runs `fn` over the microbatches of `xs` and reduces the outputs leaf-wise.

    `out_specs` (a pytree prefix of the outputs: `PartitionSpec`s or None) is a layout for the
    accumulators under `mpmd_jit_with_loop` with `gradient_reduction="microbatch"`: each
    microbatch's output is constrained to it on its group, so a gradient sharded like its
    parameter is reduce-scattered and accumulated sharded instead of all-reduced into a full
    copy per device. Values are unchanged; plain `jax.jit` ignores it, and so do deferred
    (`"step"`) partial sums, which are full-size per device by construction."""
    leaves, xs_tree = jax.tree.flatten(xs)
    if not leaves:
        raise ValueError("treduce needs at least one array in xs to split into microbatches")
    sizes = {jax.numpy.shape(x)[axis] for x in leaves}
    if len(sizes) != 1:
        raise ValueError(
            f"treduce: every leaf of xs must have the same size along axis {axis} (the number of "
            f"microbatches); got sizes {sorted(sizes)}"
        )
    n_microbatches = sizes.pop()
    mb_avals = [_drop_axis(jax.typeof(x), axis) for x in leaves]

    def body(*mb_leaves):
        return fn(jax.tree.unflatten(xs_tree, mb_leaves))

    # one trace of `fn` (a pipelined model's costs most of a step's compile): the jaxpr, and the
    # output's structure and shapes from the same trace
    trees: list = []

    def flat_body(*a):
        leaves_out, tree = jax.tree.flatten(body(*a))
        trees.append(tree)
        return leaves_out

    scope = marker.stage_counting() if _PIPELINED.get() else contextlib.nullcontext()
    with scope:
        closed, out_shapes = jax.make_jaxpr(flat_body, return_shape=True)(*mb_avals)
    out_example = jax.tree.unflatten(trees[-1], out_shapes)
    ops = broadcast_operations(operation, out_example)
    out_tree = jax.tree.structure(out_example)
    acc_specs = None
    if out_specs is not None:
        acc_specs = tuple(
            jax.tree.leaves(
                jax.tree.map(
                    lambda spec, sub: jax.tree.map(lambda _: spec, sub),
                    out_specs,
                    out_example,
                    is_leaf=lambda x: x is None or isinstance(x, jax.sharding.PartitionSpec),
                ),
                is_leaf=lambda x: x is None or isinstance(x, jax.sharding.PartitionSpec),
            )
        )

    body_jaxpr, consts = _consts_to_invars(closed)
    outs = treduce_p.bind(
        *consts,
        *leaves,
        body=body_jaxpr,
        n_consts=len(consts),
        n_microbatches=n_microbatches,
        axis=axis,
        ops=ops,
        schedule=schedule,
        acc_specs=acc_specs,
    )
    return jax.tree.unflatten(out_tree, outs)


def _drop_axis(aval, axis):
    shape = tuple(d for i, d in enumerate(aval.shape) if i != axis)
    return jax.ShapeDtypeStruct(shape, aval.dtype)


def _consts_to_invars(closed: ClosedJaxpr) -> tuple[ClosedJaxpr, list]:
    jaxpr = closed.jaxpr
    moved = Jaxpr(
        constvars=[],
        invars=[*jaxpr.constvars, *jaxpr.invars],
        outvars=jaxpr.outvars,
        eqns=jaxpr.eqns,
        effects=jaxpr.effects,
        debug_info=jaxpr.debug_info,
    )
    return ClosedJaxpr(moved, []), list(closed.consts)


def microbatch(x, index, axis):
    """The slice every engine and reference path uses for microbatch `index`."""
    return lax.dynamic_index_in_dim(x, index, axis, keepdims=False)


def run_loop(*args, body, n_consts, n_microbatches, axis, ops, schedule, acc_specs=None):
    """The reference semantics: an ordinary loop over microbatches."""
    del schedule, acc_specs
    consts, xs = args[:n_consts], args[n_consts:]
    accs = [op.init(n_microbatches, aval) for op, aval in zip(ops, body.out_avals)]
    body_fn = jaxpr_as_fun(body)

    def step(i, accs):
        outs = body_fn(*consts, *[microbatch(x, i, axis) for x in xs])
        return [op.update(a, o, i) for op, a, o in zip(ops, accs, outs)]

    return lax.fori_loop(0, n_microbatches, step, accs)


def _abstract_eval(*avals, body, n_microbatches, ops, **_):
    out = []
    for op, aval in zip(ops, body.out_avals):
        shaped = op.out_aval(n_microbatches, aval)
        out.append(jax.core.ShapedArray(shaped.shape, shaped.dtype, weak_type=aval.weak_type))
    return out


treduce_p.def_impl(lambda *args, **params: jax.jit(functools.partial(run_loop, **params))(*args))
treduce_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(treduce_p, mlir.lower_fun(run_loop, multiple_results=True))
