"""The training and evaluation steps, compiled for SPMD (`jax.jit`) or MPMD pipelines (jaxpp).

State layout (the checkpoint seam): a dict `{"step": int32[], "params": ..., "opt_state": ...}` of
plain arrays. `params` names the decoder layers `layers_0`, `layers_1`, ... when unrolled, and
stacks them under `layers` / `layers_stage_<s>` with `scan_layers=true`
(`MaxText/model/decoder.py`); the initial values are the same in every layout (`init_params`), and
checkpoints store one canonical tree (`MaxText/checkpoint/layout.py`), so a checkpoint written by
one layout can be read by another.

The step is a pure function `(state, batch) -> (state, metrics)`:

1. the batch `{"inputs", "targets", "targets_mask"}` of shape [B, L] (packed rows also
   `"inputs_segmentation"`, `"inputs_position"`: `batch_keys`) is split into
   `num_pipeline_microbatches` (M) microbatches [M, B/M, L]; microbatch i holds rows i, M+i, 2M+i...
   so every microbatch stays evenly split over the data-parallel devices;
2. `jaxpp.treduce` runs forward + backward on each microbatch and `Add`s the loss *sum*, the token
   count and the gradients (a plain loop under `jax.jit`; the pipelined loop under
   `mpmd_jit_with_loop`). Normalising once by the total token count afterwards makes the loss and
   gradients those of the full batch whatever M is;
3. gradients are clipped by global norm and applied with AdamW (`MaxText/optimizer.py`).

Metrics (MaxText's names): `loss` (mean over counted tokens), `raw_grad_norm` (before clipping),
`grad_norm` (after clipping: min(raw, gradient_clipping_threshold), the norm clip_by_global_norm
leaves), `learning_rate` (the rate this step applied), `tokens` (counted target tokens, MaxText's
`total_weights`); a mixture-of-experts model adds `moe_lb_loss` and the token-slots per expert
(`moe_metrics`), and its objective adds `load_balance_loss_weight` x the load-balancing loss,
computed per microbatch and averaged over the microbatches (`microbatch_fn`).

With `use_dpo` the step is `dpo_step.py`'s, `(state, batch, reference) -> (state, metrics)`; the
trainer binds the reference parameters (`ReferenceStep`), so the loop calls every step alike.
Chat fine-tuning (`use_sft`) needs nothing here: its rows' `targets_mask` marks the assistant's
tokens, and the loss is already the mean over the batch's counted tokens.

SPMD (one pipeline group): `jax.jit` with in/out shardings from the logical-axis rules.
Pipelined: the same function under `jaxpp.mpmd_jit_with_loop` on `MpmdMesh(mesh, "stage")`, with the
same rules giving the PartitionSpecs over the non-stage axes, and the schedule from
`pipeline_schedule`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxpp_integration as jaxpp
from MaxText import sharding
from MaxText.cluster import gpu_host
from MaxText.config import Config
from MaxText.dpo_step import DPO_METRIC_KEYS, ReferenceStep, make_dpo_train_step
from MaxText.model import Decoder, canonical_init, cross_entropy_sums, init_params, moe_stats
from MaxText.model.moe import load_balance_loss

log = logging.getLogger(__name__)

BATCH_KEYS = ("inputs", "targets", "targets_mask")
# Packed rows (dataset_type=grain, packing=true) add per-document segment ids and positions.
PACKED_BATCH_KEYS = (*BATCH_KEYS, "inputs_segmentation", "inputs_position")
METRIC_KEYS = ("loss", "grad_norm", "raw_grad_norm", "learning_rate", "tokens")
MOE_METRIC_KEYS = ("moe_lb_loss", "moe_tokens_per_expert_max", "moe_tokens_per_expert_mean")


def split_microbatches(x_BxL, num_microbatches: int):
    """[B, L] -> [M, B/M, L]; microbatch i is rows i, M+i, 2M+i, ... (keeps data sharding even)."""
    b = x_BxL.shape[0]
    x = x_BxL.reshape(b // num_microbatches, num_microbatches, *x_BxL.shape[1:])
    return jnp.swapaxes(x, 0, 1)


def batch_keys(config: Config) -> tuple[str, ...]:
    """The step's batch keys: packed rows carry segment ids and positions (MaxText's names)."""
    packed = config.dataset_type == "grain" and config.packing
    return PACKED_BATCH_KEYS if packed else BATCH_KEYS


def make_loss_fn(model: Decoder) -> Callable:
    """(params, batch) -> (loss sum, token count), and for a MoE model also the routing
    statistics [2, E] summed over its layers (`MaxText/model/moe.py`)."""
    packed = batch_keys(model.config) == PACKED_BATCH_KEYS
    is_moe = model.config.is_moe

    def loss_fn(params, batch):
        args = (batch["inputs"],)
        if packed:  # attention stays in each document; positions restart per document
            args = (batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
        if is_moe:
            logits_BxLxV, sown = model.apply({"params": params}, *args, mutable=["intermediates"])
        else:
            logits_BxLxV = model.apply({"params": params}, *args)
        sums = cross_entropy_sums(logits_BxLxV, batch["targets"], batch["targets_mask"])
        return (*sums, moe_stats(sown)) if is_moe else sums

    return loss_fn


def microbatch_fn(config: Config, model: Decoder, params, batch) -> Callable:
    """microbatch -> (loss sum, token count, gradients, MoE metrics or None): the gradient of
    the microbatch's loss sum, plus for a MoE model `load_balance_loss_weight` x its
    load-balancing loss / M scaled by the batch's token count (known before the loop), so that
    the gradients summed over the M microbatches and divided by the token count are those of
    loss + weight x (the mean over microbatches of each microbatch's load-balancing loss)."""
    loss_fn = make_loss_fn(model)
    if not config.is_moe:
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

        def dense(mb):
            (loss_sum, count), grads = grad_fn(params, mb)
            return loss_sum, count, grads, None

        return dense
    m = config.num_pipeline_microbatches
    count = jnp.maximum(jnp.sum(batch["targets_mask"].astype(jnp.float32)), 1.0)
    scale = config.load_balance_loss_weight * count / m
    routed = config.microbatch_size * config.max_target_length * config.num_decoder_layers

    def objective(p, mb):
        loss_sum, count, stats_2xX = loss_fn(p, mb)
        lb = load_balance_loss(stats_2xX, routed)
        return loss_sum + scale * lb, (loss_sum, count, {"lb": lb, "slots": stats_2xX[0]})

    grad_fn = jax.value_and_grad(objective, has_aux=True)

    def moe(mb):
        (_, (loss_sum, count, aux)), grads = grad_fn(params, mb)
        return loss_sum, count, grads, aux

    return moe


def moe_metrics(config: Config, aux) -> dict:
    """`moe_lb_loss` (the load-balancing loss, the mean over microbatches, unweighted) and the
    token-slots per expert per layer of the step (over its microbatches; averaged over layers):
    their maximum and mean over experts (the mean is tokens x k / E)."""
    slots_X = aux["slots"] / config.num_decoder_layers
    return {
        "moe_lb_loss": aux["lb"] / config.num_pipeline_microbatches,
        "moe_tokens_per_expert_max": jnp.max(slots_X),
        "moe_tokens_per_expert_mean": jnp.mean(slots_X),
    }


def make_train_step(
    config: Config,
    model: Decoder,
    optimizer: optax.GradientTransformation,
    lr_schedule: optax.Schedule,
    schedule: Any = None,
    grad_specs: Any = None,
) -> Callable:
    """The pure step function; `schedule` is the pipeline schedule (None when not pipelined).
    `grad_specs` (the parameters' PartitionSpecs, pipelined only) lays the gradient accumulators
    out like the parameters: with `gradient_reduction=microbatch` each microbatch's gradients
    are reduce-scattered over fsdp and accumulated sharded (`treduce(out_specs=...)`)."""
    m = config.num_pipeline_microbatches

    def train_step(state, batch):
        params = state["params"]
        microbatches = {k: split_microbatches(batch[k], m) for k in batch_keys(config)}
        microbatch_grads = microbatch_fn(config, model, params, batch)

        loss_sum, count, grads, aux = jaxpp.treduce(
            microbatch_grads,
            microbatches,
            schedule=schedule,
            operation=jaxpp.Add,
            out_specs=None if grad_specs is None else (None, None, grad_specs, None),
        )
        count = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g / count, grads)
        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        new_state = {
            "step": state["step"] + 1,
            "params": optax.apply_updates(params, updates),
            "opt_state": opt_state,
        }
        raw_grad_norm = optax.tree.norm(grads)
        threshold = config.gradient_clipping_threshold
        metrics = {
            "loss": loss_sum / count,
            "grad_norm": jnp.minimum(raw_grad_norm, threshold) if threshold > 0 else raw_grad_norm,
            "raw_grad_norm": raw_grad_norm,
            "learning_rate": jnp.asarray(lr_schedule(state["step"]), jnp.float32),
            "tokens": count,
        }
        if aux is not None:
            metrics.update(moe_metrics(config, aux))
        return new_state, metrics

    return train_step


def make_eval_step(model: Decoder, num_microbatches: int = 1, schedule: Any = None) -> Callable:
    """(params, batch) -> {"loss_sum", "tokens"}; the loop sums these over held-out batches.

    With a `schedule` the batch is split like the train step's and the forward pass runs as a
    pipelined `treduce` (no backward tasks), so every stage's weights stay on their group."""
    loss_fn = make_loss_fn(model)
    if model.config.is_moe:
        moe_loss_fn = loss_fn
        loss_fn = lambda params, batch: moe_loss_fn(params, batch)[:2]  # noqa: E731

    def eval_step(params, batch):
        batch = {k: batch[k] for k in batch_keys(model.config)}
        if schedule is None:
            loss_sum, count = loss_fn(params, batch)
        else:
            microbatches = {k: split_microbatches(v, num_microbatches) for k, v in batch.items()}
            loss_sum, count = jaxpp.treduce(
                lambda mb: loss_fn(params, mb), microbatches, schedule=schedule, operation=jaxpp.Add
            )
        return {"loss_sum": loss_sum, "tokens": count}

    return eval_step


def make_init_fn(config: Config, model: Decoder, optimizer: optax.GradientTransformation):
    """(rng, canonical params or None) -> state with flax partitioning boxes (optimizer moments
    inherit the param boxes); see `init_params` for `canonical`."""

    def init(rng, canonical=None):
        tokens = jnp.zeros((1, config.max_target_length), jnp.int32)
        params = init_params(model, rng, tokens, canonical)
        return {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "opt_state": optimizer.init(params),
        }

    return init


def state_specs(config: Config, model: Decoder, optimizer) -> tuple[Any, Any]:
    """(abstract unboxed state, mesh-axis PartitionSpecs with the same tree)."""
    init = make_init_fn(config, model, optimizer)
    boxed = jax.eval_shape(init, jax.random.key(0))
    specs = sharding.logical_to_specs(nn.get_partition_spec(boxed))
    return nn.unbox(boxed), specs


@dataclasses.dataclass
class Trainer:
    """Everything the loop needs to run steps, built once from the config.

    - `init_state()` -> a freshly initialised state, placed on the devices;
    - `train_step(state, batch) -> (state, metrics)` on device arrays (compiled);
    - `eval_step(params, batch) -> {"loss_sum", "tokens"}`;
    - `put_batch(np_batch)` -> the batch as the step expects it;
    - `abstract_state`, `state_specs`, `state_shardings` for checkpoint save/restore.
    """

    config: Config
    mesh: Mesh
    model: Decoder
    optimizer: optax.GradientTransformation
    lr_schedule: optax.Schedule
    abstract_state: Any
    state_specs: Any
    state_shardings: Any
    train_step: Callable
    eval_step: Callable
    init_state: Callable[[], Any]
    put_batch: Callable[[dict[str, np.ndarray]], Any]
    compile_seconds: float = 0.0
    mpmd_mesh: Any = None


def batch_shapes(config: Config, length: int | None = None) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch the step takes, as abstract arrays (the planner compiles on these)."""
    shape = (config.global_batch_size, length or config.max_target_length)
    return {
        k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "targets_mask" else jnp.int32)
        for k in batch_keys(config)
    }


def _as_step_batch(batch: dict[str, Any], keys: tuple[str, ...] = BATCH_KEYS):
    return {k: np.asarray(batch[k], np.float32 if k == "targets_mask" else np.int32) for k in keys}


def build_trainer(config: Config, mesh: Mesh, model: Decoder | None = None) -> Trainer:
    """Builds and compiles the steps for `config` on `mesh` (SPMD or pipelined)."""
    from MaxText.optimizer import make_optimizer

    model = model or Decoder(config)
    optimizer, lr_schedule = make_optimizer(config)
    abstract_state, specs = state_specs(config, model, optimizer)
    build = _build_mpmd if config.is_pipelined else _build_spmd
    return Trainer(
        config=config,
        mesh=mesh,
        model=model,
        optimizer=optimizer,
        lr_schedule=lr_schedule,
        abstract_state=abstract_state,
        state_specs=specs,
        **build(config, mesh, model, optimizer, lr_schedule, abstract_state, specs),
    )


# Initialisation runs once, and XLA:CPU spends most of its compile time optimising the random
# number generator (threefry): ~9 s for the tiny model at the default level, ~2 s at level 0.
# Not used on accelerators, where unoptimised kernels would make a large init slow.
CPU_INIT_COMPILER_OPTIONS = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
}


def init_compiler_options(mesh: Mesh) -> dict:
    return CPU_INIT_COMPILER_OPTIONS if mesh.devices.flat[0].platform == "cpu" else {}


def init_programs(mesh: Mesh, config, model, optimizer, specs):
    """(canonical, layout, shardings): the fresh state's two programs on `mesh`, not compiled.

    `canonical(rng)` makes every layer's parameters stacked (the same program whatever the
    layer layout, so the same values); `layout(rng, canonical)` the state in this layout's tree
    (optimizer state included), placed by `shardings`. benchmarks/init_memory.py compiles them
    on abstract inputs at scale."""
    shardings = sharding.named_shardings(mesh, specs)
    tokens = jnp.zeros((1, config.max_target_length), jnp.int32)
    canonical_fn = functools.partial(canonical_init, config, tokens_BxL=tokens)
    boxed = jax.eval_shape(canonical_fn, jax.random.key(0))
    canonical_shardings = sharding.named_shardings(
        mesh, sharding.logical_to_specs(nn.get_partition_spec(boxed))
    )
    canonical_jit = jax.jit(
        lambda rng: nn.unbox(canonical_fn(rng)), out_shardings=canonical_shardings
    )
    init = make_init_fn(config, model, optimizer)
    jitted = jax.jit(lambda rng, canonical: nn.unbox(init(rng, canonical)), out_shardings=shardings)
    return canonical_jit, jitted, shardings


def _init_on(mesh: Mesh, config, model, optimizer, specs):
    """(init_state(), shardings): a fresh state from `config.init_weights_seed`, sharded over
    `mesh` (`init_programs`, compiled at the first call)."""
    canonical_jit, jitted, shardings = init_programs(mesh, config, model, optimizer, specs)
    compiled = []

    def init_state():
        rng = jax.random.key(config.init_weights_seed)
        if not compiled:
            options = init_compiler_options(mesh)
            compiled.append(canonical_jit.lower(rng).compile(compiler_options=options))
            canonical = compiled[0](rng)
            compiled.append(jitted.lower(rng, canonical).compile(compiler_options=options))
        else:
            canonical = compiled[0](rng)
        return compiled[1](rng, canonical)

    return init_state, shardings


def _build_spmd(config, mesh, model, optimizer, lr_schedule, abstract_state, specs) -> dict:
    """The SPMD step's parts of the `Trainer` (`jax.jit`, compiled ahead of time)."""
    init_state, state_shardings = _init_on(mesh, config, model, optimizer, specs)
    batch_sharding = NamedSharding(mesh, sharding.batch_spec())
    batch_shardings = {k: batch_sharding for k in batch_keys(config)}
    replicated = NamedSharding(mesh, PartitionSpec())
    step = step_function(config, model, optimizer, lr_schedule)
    reference = (state_shardings["params"],) if config.use_dpo else ()
    jitted = jax.jit(
        step,
        in_shardings=(state_shardings, batch_shardings, *reference),
        out_shardings=(state_shardings, {k: replicated for k in metric_keys(config)}),
        donate_argnums=(0,),
    )
    t0 = time.perf_counter()
    abstract_in = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        abstract_state,
        state_shardings,
    )
    batch_in = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sharding)
        for k, v in batch_shapes(config).items()
    }
    reference_in = (abstract_in["params"],) if config.use_dpo else ()
    with jax.set_mesh(mesh), sharding.axis_rules():  # activation constraints
        compiled = jitted.lower(abstract_in, batch_in, *reference_in).compile()
    if config.use_dpo:
        compiled = ReferenceStep(compiled)
    compile_seconds = time.perf_counter() - t0

    eval_jitted = jax.jit(
        make_eval_step(model),
        in_shardings=(state_shardings["params"], batch_shardings),
        out_shardings={"loss_sum": replicated, "tokens": replicated},
    )
    if config.is_moe:  # the MoE block splits its experts by the mesh and rules it is traced in
        moe_eval = eval_jitted

        def eval_jitted(params, batch):
            with jax.set_mesh(mesh), sharding.axis_rules():
                return moe_eval(params, batch)

    def put_batch(batch):
        # Each process holds its own rows (MaxText.data gives B / num_processes of them).
        return {
            k: jax.make_array_from_process_local_data(batch_sharding, v)
            for k, v in _as_step_batch(batch, batch_keys(config)).items()
        }

    return dict(
        state_shardings=state_shardings,
        train_step=compiled,
        eval_step=eval_jitted,
        init_state=init_state,
        put_batch=put_batch,
        compile_seconds=compile_seconds,
    )


def step_function(config, model, optimizer, lr_schedule, schedule=None, grad_specs=None):
    """The pure step: `make_train_step`'s, or with `use_dpo` the DPO step (`dpo_step.py`), which
    also takes the frozen reference parameters: `(state, batch, reference)`."""
    if config.use_dpo:
        keys = batch_keys(config)
        return make_dpo_train_step(
            config, model, optimizer, lr_schedule, keys, schedule=schedule, grad_specs=grad_specs
        )
    return make_train_step(
        config, model, optimizer, lr_schedule, schedule=schedule, grad_specs=grad_specs
    )


def metric_keys(config: Config) -> tuple[str, ...]:
    """The step's metrics: `METRIC_KEYS`, DPO's rewards with use_dpo, a mixture of experts'
    `MOE_METRIC_KEYS`."""
    dpo = DPO_METRIC_KEYS if config.use_dpo else ()
    moe = MOE_METRIC_KEYS if config.is_moe else ()
    return (*METRIC_KEYS, *dpo, *moe)


def step_inputs(config: Config, abstract_state) -> tuple:
    """The step's abstract arguments (the planner compiles on these): state and batch, and the
    reference parameters with use_dpo."""
    reference = (abstract_state["params"],) if config.use_dpo else ()
    return (abstract_state, batch_shapes(config), *reference)


def pipelined_train_step(
    config, model, optimizer, lr_schedule, specs, mpmd_mesh, device_memory_bytes=None
):
    """The trainer's step under `mpmd_jit_with_loop` (not compiled yet); the planner compiles
    the very same function on abstract inputs. `device_memory_bytes`: what
    `gradient_reduction=auto` decides against when planning for other devices than these."""
    from jaxpp_integration.schedules import schedule_from_name

    schedule = schedule_from_name(config.pipeline_schedule, config.num_stages, config.mesh_pipeline)
    reduction = config.gradient_reduction
    if reduction == "auto" and device_memory_bytes:
        reduction = jaxpp.AutoReduction(device_memory_bytes=device_memory_bytes)
    reference = (specs["params"],) if config.use_dpo else ()
    platform = mpmd_mesh.jax_mesh.devices.flat[0].platform
    return jaxpp.mpmd_jit_with_loop(
        step_function(config, model, optimizer, lr_schedule, schedule, specs["params"]),
        mpmd_mesh=mpmd_mesh,
        compile_threads=gpu_host.compile_threads(platform),  # a GPU host's free cores
        in_specs=(specs, {k: sharding.batch_spec() for k in batch_keys(config)}, *reference),
        out_specs=(specs, {k: PartitionSpec() for k in metric_keys(config)}),
        donate_argnums=(0,),
        gradient_reduction=reduction,
        pipeline_hang_timeout_s=config.pipeline_hang_timeout_s,
        pipeline_fsdp_ag_once=config.pipeline_fsdp_ag_once,
    )


def _build_mpmd(config, mesh, model, optimizer, lr_schedule, abstract_state, specs) -> dict:
    """The pipelined step's parts of the `Trainer` (`mpmd_jit_with_loop`, compiled ahead of
    time on abstract inputs)."""
    from jaxpp_integration.schedules import schedule_from_name

    mpmd_mesh = sharding.make_mpmd_mesh(mesh)
    schedule = schedule_from_name(config.pipeline_schedule, config.num_stages, config.mesh_pipeline)
    # The state is initialised on this process's first pipeline group (every process makes the
    # same values from the seed); the first step moves each stage's share to its group and every
    # later step reuses the outputs where they live.
    first_group = mpmd_mesh.unstack[min(jaxpp.local_ranks(mpmd_mesh))]
    init_state, state_shardings = _init_on(first_group, config, model, optimizer, specs)
    batch_specs = {k: sharding.batch_spec() for k in batch_keys(config)}
    pipelined = pipelined_train_step(config, model, optimizer, lr_schedule, specs, mpmd_mesh)

    def put_batch(batch):
        # host arrays: the engine copies each to the groups that read it (first and last stage)
        return _as_step_batch(batch, batch_keys(config))

    example_batch = put_batch(
        {k: np.zeros(v.shape, v.dtype) for k, v in batch_shapes(config).items()}
    )
    batch_in = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in example_batch.items()}
    # Compiled on abstract inputs, as the planner does and as for SPMD: the engine reads only
    # shapes and dtypes, so a run that resumes from a checkpoint never compiles or runs the
    # random initialisation (which puts the whole state on one group). DPO: the reference
    # parameters have the parameters' shapes and layout (set by the loop).
    state_in, _, *reference = step_inputs(config, abstract_state)
    t0 = time.perf_counter()  # the step's compile alone, as for SPMD (not the initialisation)
    with sharding.axis_rules():  # activation constraints: batch-sharded inside each stage
        compiled = pipelined.compile(state_in, batch_in, *reference)
    compile_seconds = time.perf_counter() - t0
    log.info("%s", compiled.reduction_choice.describe())
    if config.use_dpo:
        compiled = ReferenceStep(compiled)

    eval_pipelined = jaxpp.mpmd_jit_with_loop(
        make_eval_step(model, config.num_pipeline_microbatches, schedule),
        mpmd_mesh=mpmd_mesh,
        in_specs=(specs["params"], batch_specs),
        out_specs={"loss_sum": PartitionSpec(), "tokens": PartitionSpec()},
    )

    def eval_step(params, batch):
        # Compiled at the first evaluation (every process alike: the engine meets at a barrier
        # after compiling). fetch: the sums live on the last group, maybe another process's.
        with sharding.axis_rules():  # traced at the first call
            return jaxpp.fetch(eval_pipelined(params, batch))

    eval_step.pipelined = eval_pipelined  # for inspection (tests, benchmarks)

    return dict(
        state_shardings=state_shardings,
        train_step=compiled,
        eval_step=eval_step,
        init_state=init_state,
        put_batch=put_batch,
        compile_seconds=compile_seconds,
        mpmd_mesh=mpmd_mesh,
    )


def evaluate(trainer: Trainer, params, batches: Iterable[dict[str, np.ndarray]], max_batches: int):
    """Token-weighted mean loss over up to `max_batches` held-out batches (all if <= 0)."""
    total, tokens, n = 0.0, 0.0, 0
    for batch in batches:
        if 0 < max_batches <= n:
            break
        out = trainer.eval_step(params, trainer.put_batch(batch))
        total += float(np.asarray(out["loss_sum"]))
        tokens += float(np.asarray(out["tokens"]))
        n += 1
    return total / max(tokens, 1.0), n


def measured_train_step(trainer: Trainer, state, batch, **step_kwargs):
    """One train step that also measures the peak bytes per device of each pipeline group:
    `(state, metrics, [peak per group])`. Pipelined: the engine's device-bytes measurement
    (`compiled(..., measure_device_bytes=True)`: the buffers alive on each device after every
    instruction, tracked from the program's allocation and free events and checked against the
    live buffers once, at the peak), the largest device of each group; a disagreement of that
    check is logged. SPMD: the backend's `peak_bytes_in_use` where it reports memory stats
    (GPU), else None. `step_kwargs` go to the step call (the profiler's `record_times=True`)."""
    if trainer.mpmd_mesh is None:
        state, metrics = trainer.train_step(state, batch, **step_kwargs)
        local = [d for d in trainer.mesh.devices.flat if d.process_index == jax.process_index()]
        stats = [d.memory_stats() for d in local]
        if all(s and "peak_bytes_in_use" in s for s in stats):
            return state, metrics, [max(int(s["peak_bytes_in_use"]) for s in stats)]
        return state, metrics, None
    compiled = trainer.train_step
    state, metrics = compiled(state, batch, measure_device_bytes=True, **step_kwargs)
    measured = compiled.last_device_bytes
    for index, tracked, scanned in measured.mismatches():
        log.warning(
            "device bytes after instruction %d: tracked %s, live buffers %s (a buffer outlived "
            "the program's own free events)",
            index,
            tracked,
            scanned,
        )
    mesh = trainer.mpmd_mesh
    peaks = [measured.peak([d.id for d in mesh.devices_of(g)]) for g in range(mesh.mpmd_dim)]
    return state, metrics, peaks
