"""Device memory the training step needs, read once at start and logged (as MaxText does).

- `step_memory(trainer)`: XLA's memory analysis of the compiled training step, per device:
  argument, output, alias (donated inputs whose buffers the outputs reuse) and temp (scratch:
  activations kept for the backward pass, attention scores, ...) bytes. SPMD: the step's one
  executable; `total` = arguments + outputs - aliased + temp, as MaxText reports it. Pipelined:
  one summary per pipeline group over the group's compiled tasks. The engine runs a group's tasks
  one after another, so their scratch is not summed: the largest temp of any one task is the
  group's step scratch, next to the largest arguments and outputs of a task.
- `device_memory_in_use(devices)`: bytes in use per device after initialisation,
  `device.memory_stats()["bytes_in_use"]` where the backend reports it (GPU, TPU), else the bytes
  of the live JAX arrays' shards on each device (XLA:CPU reports no memory statistics).
- `log_memory(info, trainer)` writes both as log lines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax


def _gib(n: int) -> str:
    """Bytes in the largest binary unit that keeps the figure >= 1 (MaxText logs GB)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


@dataclasses.dataclass(frozen=True)
class XlaMemory:
    """One compiled executable's `memory_analysis()`, per device, in bytes."""

    argument: int
    output: int
    alias: int
    temp: int

    @classmethod
    def of(cls, compiled) -> XlaMemory:
        a = compiled.memory_analysis()
        return cls(
            argument=int(a.argument_size_in_bytes),
            output=int(a.output_size_in_bytes),
            alias=int(a.alias_size_in_bytes),
            temp=int(a.temp_size_in_bytes),
        )

    @property
    def total(self) -> int:
        return self.argument + self.output - self.alias + self.temp

    def describe(self) -> str:
        return (
            f"arguments {_gib(self.argument)}, outputs {_gib(self.output)}, "
            f"aliased {_gib(self.alias)}, temp {_gib(self.temp)}, total {_gib(self.total)}"
        )


@dataclasses.dataclass(frozen=True)
class GroupMemory:
    """A pipeline group's compiled tasks (distinct executables), each with its analysis."""

    group: int
    tasks: tuple[tuple[str, XlaMemory], ...]

    def largest(self, field: str) -> tuple[str, int]:
        name, mem = max(self.tasks, key=lambda t: getattr(t[1], field))
        return name, getattr(mem, field)

    def describe(self) -> str:
        temp_task, temp = self.largest("temp")
        arg_task, arg = self.largest("argument")
        out_task, out = self.largest("output")
        return (
            f"pipeline group {self.group} ({len(self.tasks)} compiled tasks, per device): "
            f"largest temp {_gib(temp)} ({temp_task}), largest arguments {_gib(arg)} "
            f"({arg_task}), largest outputs {_gib(out)} ({out_task})"
        )


def step_memory(train_step) -> XlaMemory | list[GroupMemory] | None:
    """The compiled step's analysis: one `XlaMemory` (SPMD) or one `GroupMemory` per group (its
    task programs, from the engine's report); None for a step that is not compiled (e.g. a
    test's plain function)."""
    report = getattr(train_step, "report", None)
    if report is None:
        return XlaMemory.of(train_step) if hasattr(train_step, "memory_analysis") else None
    per_group: dict[int, dict[str, tuple[str, XlaMemory]]] = {}
    for t in report().tasks:
        if t.group not in train_step.local_ranks:  # compiled by another process
            continue
        tasks = per_group.setdefault(t.group, {})
        if t.program not in tasks:
            mem = XlaMemory(t.argument_bytes, t.output_bytes, t.alias_bytes, t.temp_bytes)
            tasks[t.program] = (t.program, mem)
    return [GroupMemory(g, tuple(per_group[g].values())) for g in sorted(per_group)]


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """Bytes in use per device and where the figure comes from."""

    in_use: dict[str, int]  # device name -> bytes
    limit: dict[str, int]  # device name -> bytes (empty where the backend reports no limit)
    source: str  # "memory_stats" | "live arrays"

    def describe(self) -> str:
        name = max(self.in_use, key=self.in_use.get)
        total = sum(self.in_use.values())
        text = f"max {_gib(self.in_use[name])} on {name}"
        if name in self.limit:
            text += (
                f" of {_gib(self.limit[name])} ({100 * self.in_use[name] / self.limit[name]:.1f}%)"
            )
        return f"{text}, {_gib(total)} over {len(self.in_use)} devices ({self.source})"


def _name(device) -> str:
    return f"{device.platform}:{device.id}"


def live_array_bytes(devices: Sequence[Any]) -> dict[str, int]:
    """Bytes of the live JAX arrays' shards on each of `devices`."""
    wanted = {_name(d): 0 for d in devices}
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            key = _name(shard.device)
            if key in wanted:
                wanted[key] += int(shard.data.nbytes)
    return wanted


def device_memory_in_use(devices: Sequence[Any]) -> DeviceMemory:
    stats = [d.memory_stats() for d in devices]
    if all(s and "bytes_in_use" in s for s in stats):
        in_use = {_name(d): int(s["bytes_in_use"]) for d, s in zip(devices, stats)}
        limit = {
            _name(d): int(s["bytes_limit"]) for d, s in zip(devices, stats) if "bytes_limit" in s
        }
        return DeviceMemory(in_use, limit, "memory_stats")
    return DeviceMemory(live_array_bytes(devices), {}, "live arrays")


def log_memory(info: Callable[[str], None], train_step, devices: Sequence[Any]) -> None:
    """The compiled step's XLA memory analysis and the device memory in use, as log lines."""
    analysis = step_memory(train_step)
    if analysis is None:
        info("XLA memory of the step: not available (the step is not a compiled executable)")
    elif isinstance(analysis, XlaMemory):
        info(f"XLA memory of the step (per device): {analysis.describe()}")
    else:
        for group in analysis:
            info(f"XLA memory of {group.describe()}")
    info(f"device memory in use after initialisation: {device_memory_in_use(devices).describe()}")
