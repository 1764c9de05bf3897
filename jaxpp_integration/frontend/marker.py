"""The stage marker: `pipeline_enter_stage` and its primitive.

A marker is a linear identity on a pytree. It is bound as the `pipeline_marker` primitive only
while `treduce` traces its loop body under `mpmd_jit_with_loop` (a scoped `StageCounter` is
active); everywhere else (plain `jax.jit`, eager, `vmap`, `remat`, `scan`) it returns its input
unchanged, so the same model runs unpipelined.

The primitive's transpose re-binds it with `phase="bwd"` and the same stage id, so after
`jax.value_and_grad` the loop body reads: fwd markers 0..k-1, then bwd markers k-1..0.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os

import jax
from jax.extend.core import Primitive, jaxprs_in_params
from jax.interpreters import ad, batching, mlir

from jaxpp_integration.jax_compat import user_source_line

marker_p = Primitive("pipeline_marker")
marker_p.multiple_results = True


@dataclasses.dataclass
class StageCounter:
    """Numbers the markers met while one loop body is traced (scoped, never global)."""

    next_stage: int = 0

    def take(self) -> int:
        stage = self.next_stage
        self.next_stage += 1
        return stage


_ACTIVE_COUNTER: contextvars.ContextVar[StageCounter | None] = contextvars.ContextVar(
    "jaxpp_stage_counter", default=None
)


@contextlib.contextmanager
def stage_counting():
    """Activates markers for the body traced inside; yields the counter."""
    counter = StageCounter()
    token = _ACTIVE_COUNTER.set(counter)
    try:
        yield counter
    finally:
        _ACTIVE_COUNTER.reset(token)


@contextlib.contextmanager
def markers_inactive():
    """Deactivates markers (e.g. while `treduce` probes its body's output shapes)."""
    token = _ACTIVE_COUNTER.set(None)
    try:
        yield
    finally:
        _ACTIVE_COUNTER.reset(token)


@contextlib.contextmanager
def forward_pass():
    """Markers inside the block number the stages from 0 again, and after it the numbering goes
    on where it was: a second forward pass through the same stages in one loop body (a frozen
    reference model's, forward only, before the trained model's pass). The partitioner puts
    each pass's stage-s work into `fwd_s`. A no-op outside a pipelined `treduce`."""
    counter = _ACTIVE_COUNTER.get()
    if counter is None:
        yield
        return
    saved, counter.next_stage = counter.next_stage, 0
    try:
        yield
    finally:
        counter.next_stage = saved


def pipeline_enter_stage(x, name: str | None = None):
    """Closes the current pipeline stage at `x` (identity on any pytree)."""
    counter = _ACTIVE_COUNTER.get()
    if counter is None:
        return x
    leaves, treedef = jax.tree.flatten(x)
    if not leaves:
        raise ValueError(
            "pipeline_enter_stage needs at least one array to mark; got an empty pytree"
        )
    out = marker_p.bind(*leaves, stage_id=counter.take(), phase="fwd", name=name)
    return jax.tree.unflatten(treedef, out)


# Aliases used by the seeds and newer JaxPP releases.
mark_stage_end = pipeline_enter_stage
pipeline_yield = pipeline_enter_stage


def _abstract_eval(*avals, **_):
    return list(avals)


def _transpose(cts, *args, stage_id, phase, name):
    del phase
    cts = [ad.instantiate_zeros(ct) for ct in cts]
    return marker_p.bind(*cts, stage_id=stage_id, phase="bwd", name=name)


def _batch(args, dims, **params):
    return marker_p.bind(*args, **params), dims


marker_p.def_impl(lambda *args, **_: list(args))
marker_p.def_abstract_eval(_abstract_eval)
ad.deflinear2(marker_p, _transpose)
batching.primitive_batchers[marker_p] = _batch
mlir.register_lowering(marker_p, lambda ctx, *args, **_: list(args))


def is_marker(eqn) -> bool:
    return eqn.primitive is marker_p


# What the user wrote, for the primitives that carry a sub-jaxpr.
_CONSTRUCTS = {
    "checkpoint": "jax.checkpoint / remat",
    "remat2": "jax.checkpoint / remat",
    "jit": "jax.jit",
    "pjit": "jax.jit",
    "closed_call": "a nested call",
    "core_call": "a nested call",
    "scan": "lax.scan",
    "cond": "lax.cond",
    "while": "lax.while_loop",
    "custom_jvp_call": "jax.custom_jvp",
    "custom_vjp_call": "jax.custom_vjp",
    "custom_vjp_call_jaxpr": "jax.custom_vjp",
    "shard_map": "shard_map",
}
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the engine


def check_markers_top_level(jaxpr) -> None:
    """Raises if a stage marker sits inside a sub-jaxpr of the loop body (in `remat`, `jit`,
    `scan`, `cond`, ...): the partitioner cuts only the body's top-level equations, so such a
    marker would be ignored or mis-number the stages. Names the marker's source line and every
    enclosing construct, innermost first."""
    found = _first_nested_marker(jaxpr, ())
    if found is None:
        return
    eqn, enclosing = found
    inside = " inside ".join(_CONSTRUCTS.get(p, p) for p in reversed(enclosing))
    raise ValueError(
        f"pipeline_enter_stage at {user_source_line(eqn, _PACKAGE_DIR)} is inside {inside}, "
        "where the engine cannot cut stages; move the marker to the top level of the microbatch "
        "function (between remat/jit/scan/cond blocks, not inside them)"
    )


def _first_nested_marker(jaxpr, enclosing: tuple):
    for eqn in jaxpr.eqns:
        if is_marker(eqn) and enclosing:
            return eqn, enclosing
        for sub in jaxprs_in_params(eqn.params):
            found = _first_nested_marker(sub, (*enclosing, eqn.primitive.name))
            if found is not None:
                return found
    return None
