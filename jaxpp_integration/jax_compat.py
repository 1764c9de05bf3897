"""The only module that touches private JAX (`jax._src`); a JAX upgrade should change only this."""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import threading

import numpy as np

_log = logging.getLogger("jaxpp_integration")


def source_line(eqn) -> str:
    """'file.py:123 (fn)' for an equation, or '<unknown>'."""
    try:
        from jax._src import source_info_util

        return source_info_util.summarize(eqn.source_info)
    except Exception:  # pragma: no cover - best effort across JAX versions
        return "<unknown source line>"


def eqn_source_context(eqn):
    """A context in which equations bound again carry `eqn`'s source line and name stack."""
    import contextlib

    try:
        from jax._src import source_info_util

        info = eqn.source_info
        return source_info_util.user_context(info.traceback, name_stack=info.name_stack)
    except Exception:  # pragma: no cover - best effort across JAX versions
        return contextlib.nullcontext()


def user_source_line(eqn, skip_dir: str) -> str:
    """Like `source_line`, but also skips frames whose file lies under `skip_dir` (e.g. this
    package, so a marker's equation names the model line that called `pipeline_enter_stage`)."""
    try:
        from jax._src import source_info_util

        for frame in source_info_util.user_frames(eqn.source_info.traceback):
            if not frame.file_name.startswith(skip_dir):
                return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"
    except Exception:  # pragma: no cover - best effort across JAX versions
        pass
    return source_line(eqn)


def shard_map(f, *, mesh, in_specs, out_specs, check: bool = True):
    """`jax.shard_map` where it exists (newer JAX), else the experimental one. `check=False`
    turns off the replication check (for outputs equal across an axis by construction)."""
    import jax

    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)
    from jax.experimental.shard_map import shard_map as legacy

    return legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check)


def backends_started() -> bool:
    """Whether this process has started a JAX backend (after which XLA_FLAGS and the GPU
    memory variables are read no more)."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def wait_at_barrier(name: str, timeout_s: float) -> None:
    """All processes meet at `name` through the coordination service (no device collective, so
    no gloo/NCCL context timeout while slower processes are still compiling)."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        return
    client.wait_at_barrier(name, timeout_in_ms=int(timeout_s * 1000))


def kv_set(key: str, value: str) -> None:
    """Stores `value` under `key` in `jax.distributed`'s key-value store (set once per key)."""
    from jax._src import distributed

    distributed.global_state.client.key_value_set(key, value)


def kv_get(key: str, timeout_s: float) -> str:
    """The value under `key` in `jax.distributed`'s key-value store, waiting up to `timeout_s`
    for another process to set it."""
    from jax._src import distributed

    return distributed.global_state.client.blocking_key_value_get(key, int(timeout_s * 1000))


def same_shard_layout(src, dst, shape) -> bool:
    """Whether `dst` cuts an array of `shape` into the same blocks, in the same device order, as
    `src` (the same spec on another group's devices): then a copy moves shard i to device i."""
    a = list(src.addressable_devices_indices_map(shape).values())
    b = list(dst.addressable_devices_indices_map(shape).values())
    return a == b and len(src.addressable_devices) == len(src.device_set)


def copy_shards(arrays: list, shardings: list) -> list:
    """Copies each array shard by shard to the devices of `shardings[i]` (which must satisfy
    `same_shard_layout`), all in one runtime call. This is the copy `jax.device_put` ends in,
    without its per-call argument handling: about 5 us per array instead of 50 on this CPU."""
    return shard_copier(shardings)(arrays)


def shard_copier(shardings: list):
    """`copy(arrays)` = `copy_shards(arrays, shardings)`, with everything that depends only on
    the target shardings worked out once (for a copy the runtime makes every step)."""
    import jax

    shardings = list(shardings)
    try:
        from jax._src.lib import xla_client as xc

        batched = xc.batched_copy_array_to_devices_with_sharding
        reuse = [xc.ArrayCopySemantics.REUSE_INPUT] * len(shardings)
        devices = [s._internal_device_list.addressable_device_list for s in shardings]
    except (ImportError, AttributeError):  # pragma: no cover - another JAX version
        return lambda arrays: jax.device_put(list(arrays), shardings)
    return lambda arrays: batched(arrays, devices, shardings, reuse)


def load_compiled_on(
    compiled, src_devices, dst_devices, serialized: bytes | None = None, name: str = "a program"
):
    """`compiled` (a `jax.stages.Compiled` for `src_devices`) loaded onto `dst_devices` without
    compiling again: device `src_devices[i]` becomes `dst_devices[i]`, in the executable's device
    assignment and in every input/output sharding. The XLA executable is serialized and
    deserialized with the new device list (what JAX's own cross-host executable sharing does);
    `serialized`: its bytes when already at hand (as read from the persistent compilation cache:
    XLA:CPU cannot serialize a deserialized executable again).
    Returns None where this JAX version or this executable does not allow it (host callbacks,
    closed-over constants, shardings of an unknown kind, devices of another process), and when
    relocating fails for any other reason (a PJRT plugin that cannot serialize or deserialize
    this executable, or rejects the new device list): then it logs one line saying so. The
    caller then compiles. `name`: the program, for that line."""
    try:
        return _relocated(compiled, src_devices, dst_devices, serialized)
    except Exception as e:  # any plugin failure: compiling is always a correct fallback
        _log.warning(
            "jaxpp: could not load %s onto devices %s (%s: %s); compiling it there instead",
            name,
            [d.id for d in dst_devices],
            type(e).__name__,
            str(e).splitlines()[0][:200] if str(e) else "",
        )
        return None


def _relocated(compiled, src_devices, dst_devices, serialized):
    """`load_compiled_on`'s work; raises on a failure it does not foresee."""
    import dataclasses

    import jax
    from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

    try:
        from jax._src.lib import xla_client as xc
        from jax._src.sharding_impls import GSPMDSharding

        unloaded = compiled._executable._unloaded_executable
        if unloaded is None or unloaded.host_callbacks or unloaded.mut:
            return None
        if compiled._params.const_args or unloaded.pgle_profiler is not None:
            return None
        old_devices = list(unloaded.device_list)
    except (AttributeError, ImportError):  # pragma: no cover - another JAX version
        return None
    me = jax.process_index()
    if any(d.process_index != me for d in (*src_devices, *dst_devices)):
        return None  # another process's devices: only compile there (multi-controller)
    move = dict(zip(src_devices, dst_devices, strict=True))
    if any(d not in move for d in old_devices):
        return None
    meshes: dict = {}

    def moved(s):
        if isinstance(s, NamedSharding) and isinstance(s.mesh, Mesh):
            m = s.mesh
            if m not in meshes:
                devs = m.devices
                flat = [move.get(d) for d in devs.flat]
                if any(d is None for d in flat):
                    return None
                arr = np.array(flat, dtype=object).reshape(devs.shape)
                meshes[m] = Mesh(arr, m.axis_names, axis_types=m.axis_types)
            return NamedSharding(meshes[m], s.spec, memory_kind=s.memory_kind)
        if isinstance(s, SingleDeviceSharding):
            (d,) = s.device_set
            return SingleDeviceSharding(move[d], memory_kind=s.memory_kind) if d in move else None
        if isinstance(s, GSPMDSharding):
            devs = [move.get(d) for d in s._device_assignment]
            if any(d is None for d in devs):
                return None
            return GSPMDSharding(devs, s._hlo_sharding, memory_kind=s.memory_kind)
        return None

    ins = [moved(s) for s in unloaded.input_shardings]
    outs = [moved(s) for s in unloaded.output_shardings]
    if any(s is None for s in ins + outs):
        return None
    device_list = xc.DeviceList(tuple(move[d] for d in old_devices))
    backend = unloaded.backend
    options = xc.CompileOptions()
    options.num_replicas = 1
    options.num_partitions = len(old_devices)
    options.device_assignment = xc.DeviceAssignment.create(
        np.array([[d.id for d in device_list]], dtype=int)
    )
    if serialized is None:
        serialized = backend.serialize_executable(unloaded.xla_executable)
    xla_exe = backend.deserialize_executable(
        serialized,
        executable_devices=device_list,
        compile_options=options,
    )
    relocated = dataclasses.replace(
        unloaded,
        xla_executable=xla_exe,
        device_list=device_list,
        input_shardings=tuple(ins),
        output_shardings=tuple(outs),
    )
    return jax.stages.Compiled(
        relocated.load(), [], compiled.args_info, compiled.out_tree, no_kwargs=compiled._no_kwargs
    )


def saved_residuals(fn, *args) -> list[tuple[object, bool]]:
    """What reverse-mode differentiation of `fn(*args)` keeps from the forward pass for the
    backward pass: (abstract value, is one of `args`) per residual. The public
    `jax.ad_checkpoint.print_saved_residuals` only prints this list."""
    from jax._src.ad_checkpoint import saved_residuals as _saved

    return [(aval, why.startswith("from the argument")) for aval, why in _saved(fn, *args)]


def reset_compilation_cache() -> None:
    """Forget JAX's persistent compilation cache object, so that the next compile opens the
    directory configured now (JAX opens it once per process otherwise)."""
    from jax._src import compilation_cache

    compilation_cache.reset_cache()


_ATOMIC_PUT = []


def atomic_persistent_cache_writes() -> None:
    """Makes JAX's persistent compilation cache write each entry whole in a local directory
    (once per process): to a temporary file, renamed into place. JAX writes an entry in place,
    so a process reading it meanwhile (runs sharing one `jax_cache_dir`, the test suite's
    workers) gets a partial entry, warns and compiles again. Eviction-enabled caches (which lock
    every access) and non-local directories are left as JAX writes them."""
    if _ATOMIC_PUT:
        return
    try:
        from jax._src import lru_cache

        original, suffix = lru_cache.LRUCache.put, lru_cache._CACHE_SUFFIX
    except (ImportError, AttributeError):  # pragma: no cover - another JAX version
        _ATOMIC_PUT.append(None)
        return

    def put(self, key: str, value: bytes) -> None:
        folder = os.fspath(getattr(self, "path", ""))  # JAX's Path: pathlib's or etils'
        if self.eviction_enabled or not key or "://" in folder or not os.path.isdir(folder):
            return original(self, key, value)
        final = pathlib.Path(folder, f"{key}{suffix}")
        if final.exists():
            return  # as JAX: the first writer's entry stays
        partial = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}.partial")
        partial.write_bytes(value)
        os.replace(partial, final)

    lru_cache.LRUCache.put = put
    _ATOMIC_PUT.append(original)


_READS = threading.local()  # the `persistent_cache_reads` record of this thread, if any
_READS_HOOKED = []


def _hook_cache_reads() -> None:
    """Wraps JAX's unpacking of a persistent-cache entry (once per process) so that the
    executable bytes it reads are handed to the active `persistent_cache_reads` record."""
    if _READS_HOOKED:
        return
    try:
        from jax._src import compilation_cache
    except ImportError:  # pragma: no cover - another JAX version: no bytes, see the caller
        _READS_HOOKED.append(None)
        return
    unpack = compilation_cache.extract_executable_and_time

    def recorded(executable_and_time):
        serialized, compile_time = unpack(executable_and_time)
        record = getattr(_READS, "record", None)
        if record is not None:
            record.serialized.append(serialized)
        return serialized, compile_time

    compilation_cache.extract_executable_and_time = recorded
    _READS_HOOKED.append(unpack)


@contextlib.contextmanager
def persistent_cache_reads():
    """Counts, in `.hits` of the yielded object, the programs this thread read from JAX's
    persistent compilation cache while the block ran, and keeps in `.serialized` the executable
    bytes read: XLA:CPU cannot serialize an executable it deserialized, so `load_compiled_on`
    moves such a program onto other devices from these bytes."""
    import jax

    class Reads:
        hits = 0

        def __init__(self):
            self.serialized = []

    reads, me = Reads(), threading.get_ident()

    def listener(event, **kwargs):
        if event == "/jax/compilation_cache/cache_hits" and threading.get_ident() == me:
            reads.hits += 1

    _hook_cache_reads()
    outer = getattr(_READS, "record", None)
    _READS.record = reads
    jax.monitoring.register_event_listener(listener)
    try:
        yield reads
    finally:
        jax.monitoring.unregister_event_listener(listener)
        _READS.record = outer


@contextlib.contextmanager
def without_persistent_cache():
    """A context in which compiles neither read nor write JAX's persistent compilation cache.
    JAX decides once per process whether the cache is used, so the decision is reset on entry
    and on exit (compiles of other threads meanwhile may skip the cache too)."""
    from jax._src import compilation_cache, config

    with config.enable_compilation_cache(False):
        compilation_cache.reset_cache()
        try:
            yield
        finally:
            compilation_cache.reset_cache()


@contextlib.contextmanager
def persistent_cache_writes_here():
    """Inside, a process other than process 0 writes the programs it compiles to JAX's
    persistent compilation cache too. JAX writes from process 0 only (every process compiles the
    same SPMD programs); a process that compiles only its own pipeline groups' programs is the
    only one that has them, so without this a restart would compile them again. Use it only
    around compiles of programs on this process's devices (other processes write theirs)."""
    import threading

    from jax._src import compilation_cache, compiler, config, distributed

    original = compiler._cache_write
    lock = threading.Lock()

    def write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        if distributed.global_state.process_id == 0:
            return original(
                cache_key, compile_time_secs, module_name, backend, executable, host_callbacks
            )
        if (
            host_callbacks
            or compile_time_secs < config.persistent_cache_min_compile_time_secs.value
        ):  # noqa: E501
            return None  # JAX's own rules for what it writes
        with lock:
            compilation_cache.put_executable_and_time(
                cache_key, module_name, executable, backend, int(compile_time_secs)
            )
        return None

    compiler._cache_write = write
    try:
        yield
    finally:
        compiler._cache_write = original
