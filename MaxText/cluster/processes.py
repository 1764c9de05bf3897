"""Which process this is in a multi-process run: the config's keys, or the launcher's environment.

Several processes need the coordinator's address (host:port of process 0), the number of
processes and this process's index. They are the keys `coordinator_address`, `num_processes`,
`process_id`; with `num_processes=-1`, or `hardware=gpu_multiprocess` without
`coordinator_address`, they come from the launcher that started the processes (an explicit
`coordinator_address` still wins):

- SLURM (`srun`): `SLURM_NTASKS`, `SLURM_PROCID`; the coordinator is the first host of
  `SLURM_STEP_NODELIST` on a port derived from `SLURM_JOB_ID` (61440 + job id mod 4096, JAX's
  rule), so every process computes the same address;
- Open MPI (`mpirun`): `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_RANK`; the coordinator host from
  `OMPI_MCA_orte_hnp_uri` (Open MPI 4: the node running mpirun), the port from its job id. Open
  MPI 5 does not export it: give `coordinator_address=<first node>:<port>` too.

The engine keeps each pipeline group inside one process, so a GPU run has one process per node
owning all of the node's GPUs (`srun --ntasks-per-node=1`, `mpirun --npernode 1`); more than one
process on a node with GPUs is refused here, with that fix. Only the environment is read: nothing
is started (`MaxText.cluster.devices` starts `jax.distributed`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

from MaxText.config import Config, ConfigError

ONE_PER_NODE = (
    "this trainer runs one process per node with all of the node's GPUs (each pipeline group "
    "lives inside one process); start it with srun --ntasks-per-node=1 or mpirun --npernode 1"
)


@dataclasses.dataclass(frozen=True)
class Processes:
    coordinator_address: str
    num_processes: int
    process_id: int
    per_node: int = 1  # processes the launcher started on this node (1 when not told)
    launcher: str = ""  # "srun" | "mpirun" | "" (the config's keys)


def _port(job_id: int) -> int:
    return 61440 + job_id % 4096


def _slurm(env: Mapping[str, str]) -> Processes | None:
    needed = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID")
    if not all(k in env for k in needed):
        return None
    # the first host: "gpu017", "gpu[017-018,020],cpu1" -> "gpu017"
    head = re.match(r"([^,\[]*)(?:\[([^,\]-]*))?", env["SLURM_STEP_NODELIST"])
    host = head.group(1) + (head.group(2) or "")
    # tasks on this node: SLURM_STEP_TASKS_PER_NODE lists "count(xnodes)" per node, e.g. "2(x3),1"
    counts = [
        int(n)
        for n, times in re.findall(
            r"(\d+)(?:\(x(\d+)\))?", env.get("SLURM_STEP_TASKS_PER_NODE", "")
        )
        for _ in range(int(times or 1))
    ]
    node = int(env.get("SLURM_NODEID", 0))
    per_node = counts[node] if node < len(counts) else 1
    n, pid = int(env["SLURM_NTASKS"]), int(env["SLURM_PROCID"])
    return Processes(f"{host}:{_port(int(env['SLURM_JOB_ID']))}", n, pid, per_node, "srun")


def _open_mpi(env: Mapping[str, str]) -> Processes | None:
    if "OMPI_COMM_WORLD_RANK" not in env or "OMPI_COMM_WORLD_SIZE" not in env:
        return None
    coordinator = ""
    uri = env.get("OMPI_MCA_orte_hnp_uri", "")  # "1531576320.0;tcp://10.96.0.1,10.1.0.1:34911"
    found = re.search(r"tcp://([^,:/]+)|tcp6://\[([^,\]]+)", uri)
    if found:
        host = found.group(1) or f"[{found.group(2)}]"
        coordinator = f"{host}:{_port(int(uri.split('.', 1)[0]) // 4096)}"
    per_node = int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", 1))
    rank, size = int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"])
    return Processes(coordinator, size, rank, per_node, "mpirun")


def for_config(config: Config, environ: Mapping[str, str] | None = None) -> Processes:
    """The processes of `config`'s run: its keys, or the launcher's (see the module docstring)."""
    if not config.processes_pending:
        return Processes(config.coordinator_address, config.num_processes, config.process_id)
    env = os.environ if environ is None else environ
    why = "num_processes=-1" if config.num_processes == -1 else "hardware=gpu_multiprocess"
    found = _slurm(env) or _open_mpi(env)
    if found is None:
        raise ConfigError(
            f"{why} takes the processes from the launcher, but no srun or mpirun started this "
            f"one (no SLURM_PROCID or OMPI_COMM_WORLD_RANK); start one process per node with "
            f"srun --ntasks-per-node=1 or mpirun --npernode 1, or set "
            f"coordinator_address=host:port num_processes=N process_id=I"
        )
    found = dataclasses.replace(
        found, coordinator_address=config.coordinator_address or found.coordinator_address
    )
    if not found.coordinator_address:
        raise ConfigError(
            f"{why}: mpirun does not say where process 0 runs (Open MPI 5); set "
            f"coordinator_address=<the first node>:<a free port> as well"
        )
    if found.per_node > 1 and config.hardware in ("gpu", "gpu_multiprocess"):
        raise ConfigError(
            f"{found.launcher} started {found.per_node} processes on this node; {ONE_PER_NODE}"
        )
    return found
