"""Multi-node launch: the processes of a run from SLURM (`srun`) or Open MPI (`mpirun`), and the
arguments `jax.distributed.initialize` gets (faked environments, on CPU).

On CPU `local_device_ids` only sets the CUDA visible devices, so the one-GPU-per-process symptom
cannot be reproduced here; what is asserted is that every process keeps all of its node's GPUs:
`jax.distributed.initialize` gets explicit values with cluster detection off (JAX's detection
would set `local_device_ids=[SLURM_LOCALID]`). The 2-process run started through the SLURM path
is in tests/test_launch.py.
"""

from __future__ import annotations

import os

import jax
import pytest

from MaxText.cluster import devices, processes
from MaxText.config import CONFIGS_DIR, ConfigError, load_config

BASE = str(CONFIGS_DIR / "base.yml")
# 2 nodes x 8 GPUs, one pipeline group of 8 per node
TWO_NODES = ["pipeline_parallelism=2", "ici_fsdp_parallelism=8", "num_kv_heads=4"]

SLURM = {  # `srun --nodes=2 --ntasks-per-node=1` on gpu017-gpu018, as seen by the second task
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_NODELIST": "gpu[017-018]",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
}
OPEN_MPI = {  # `mpirun -np 2 --npernode 1` (Open MPI 4), as seen by rank 0
    "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
}


class Started(Exception):
    """Raised by the fake `jax.distributed.initialize` once it has recorded its arguments."""


@pytest.fixture
def launcher(monkeypatch):
    """Sets a fake launcher environment (env vars only) and records jax.distributed.initialize."""
    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_", "PMIX_")):
            monkeypatch.delenv(name)
    calls = []

    def initialize(*args, **kwargs):
        calls.append((args, kwargs))
        raise Started

    monkeypatch.setattr(jax.distributed, "initialize", initialize)
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)

    def use(env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return calls

    return use


def start(*overrides):
    with pytest.raises(Started):
        devices.start(load_config([BASE, *TWO_NODES, *overrides]))


def test_srun_gives_each_process_all_of_its_nodes_gpus(launcher):
    calls = launcher(SLURM)
    start("hardware=gpu_multiprocess")
    # the first node of the step, on JAX's port for the job: 61440 + 4242 % 4096
    assert calls == [
        (
            (),
            {
                "coordinator_address": "gpu017:61586",
                "num_processes": 2,
                "process_id": 1,
                "cluster_detection_method": "deactivate",
            },
        )
    ]


def test_mpirun_gives_each_process_all_of_its_nodes_gpus(launcher):
    calls = launcher(OPEN_MPI)
    start("hardware=gpu_multiprocess")
    # mpirun's node, on JAX's port for the job: 61440 + (1531576320 // 4096) % 4096
    assert calls[0][1] == {
        "coordinator_address": "10.96.0.1:62624",
        "num_processes": 2,
        "process_id": 0,
        "cluster_detection_method": "deactivate",
    }


def test_num_processes_minus_one_takes_the_launchers_processes_on_any_hardware(launcher):
    """`num_processes=-1` is the launcher path without asking for GPUs (tests/test_launch.py runs
    it on CPU); an explicit coordinator_address still wins (Open MPI 5 exports no address)."""
    calls = launcher({k: v for k, v in OPEN_MPI.items() if k != "OMPI_MCA_orte_hnp_uri"})
    config = load_config([BASE, *TWO_NODES, "num_processes=-1"])
    with pytest.raises(ConfigError) as info:
        devices.start(config)
    assert str(info.value) == (
        "num_processes=-1: mpirun does not say where process 0 runs (Open MPI 5); set "
        "coordinator_address=<the first node>:<a free port> as well"
    )
    start("num_processes=-1", "coordinator_address=node1:1234", "hardware=cpu")
    assert calls[0][1] == {
        "coordinator_address": "node1:1234",
        "num_processes": 2,
        "process_id": 0,
        "cluster_detection_method": "deactivate",
    }


def test_explicit_keys_under_srun_turn_detection_off(launcher):
    """The trainer's own keys under srun: JAX would still detect SLURM and set
    local_device_ids=[SLURM_LOCALID] (one GPU per process); detection is off instead."""
    calls = launcher(SLURM)
    start("hardware=gpu", "coordinator_address=10.0.0.1:1234", "num_processes=2", "process_id=1")
    assert calls[0][1] == {
        "coordinator_address": "10.0.0.1:1234",
        "num_processes": 2,
        "process_id": 1,
        "cluster_detection_method": "deactivate",
    }


def test_one_process_per_gpu_is_refused_with_the_rule(launcher):
    calls = launcher({**SLURM, "SLURM_NTASKS": "16", "SLURM_STEP_TASKS_PER_NODE": "8(x2)"})
    with pytest.raises(ConfigError) as info:
        devices.start(load_config([BASE, *TWO_NODES, "hardware=gpu_multiprocess"]))
    assert str(info.value) == (
        "srun started 8 processes on this node; this trainer runs one process per node with "
        "all of the node's GPUs (each pipeline group lives inside one process); start it with "
        "srun --ntasks-per-node=1 or mpirun --npernode 1"
    )
    assert calls == []  # refused before jax.distributed starts


def test_no_launcher_is_one_line(launcher):
    launcher({})
    with pytest.raises(ConfigError) as info:
        devices.start(load_config([BASE, "hardware=gpu_multiprocess"]))
    assert str(info.value) == (
        "hardware=gpu_multiprocess takes the processes from the launcher, but no srun or mpirun "
        "started this one (no SLURM_PROCID or OMPI_COMM_WORLD_RANK); start one process per node "
        "with srun --ntasks-per-node=1 or mpirun --npernode 1, or set "
        "coordinator_address=host:port num_processes=N process_id=I"
    )


@pytest.mark.parametrize(
    "nodelist, host",
    [("gpu017", "gpu017"), ("gpu017,gpu018", "gpu017"), ("n[007,009-012],cpu1", "n007")],
)
def test_slurm_coordinator_is_the_first_node(nodelist, host):
    env = {**SLURM, "SLURM_STEP_NODELIST": nodelist, "SLURM_JOB_ID": "4096"}
    assert processes._slurm(env) == processes.Processes(f"{host}:61440", 2, 1, 1, "srun")


class _Gpu:
    platform, device_kind = "gpu", "NVIDIA H100"

    def __init__(self, i, process):
        self.id, self.process_index = i, process


def test_too_few_gpus_per_process_says_the_rule(monkeypatch):
    """What the one-GPU-per-process symptom looked like ("needs 16 devices but this host has 2"):
    now the message says how many each process needs and how to launch."""
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: None)
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax, "devices", lambda: [_Gpu(0, 0), _Gpu(1, 1)])
    with pytest.raises(ConfigError) as info:
        devices.setup(
            16,
            num_processes=2,
            coordinator_address="gpu017:1234",
            process_id=0,
            parallelism="ici_pipeline_parallelism=2 ici_fsdp_parallelism=8",
            hardware="gpu_multiprocess",
        )
    assert str(info.value) == (
        "ici_pipeline_parallelism=2 ici_fsdp_parallelism=8 needs 16 devices, 8 in each of 2 "
        "processes, but process 0 has 1 GPU devices; this trainer runs one process per node with "
        "all of the node's GPUs (each pipeline group lives inside one process); start it with "
        "srun --ntasks-per-node=1 or mpirun --npernode 1, and do not give each process one GPU "
        "(CUDA_VISIBLE_DEVICES, JAX_LOCAL_DEVICE_IDS)"
    )


PROXIES = {"http_proxy": "http://proxy:3128", "https_proxy": "http://proxy:3128"}


def _script_argv(tmp_path, script, launcher, env):
    """The command line `script` hands to `launcher` (a fake on PATH that records it; the
    proxy variables it is started with go to `proxies.txt`), run with a proxy configured."""
    import subprocess

    fake = tmp_path / launcher
    fake.write_text(
        '#!/bin/bash\nprintf "%s\\n" "$@" > "$RECORD"\n'
        'env | grep -i "_proxy=" > "$RECORD.proxies" || true\n'
    )
    fake.chmod(0o755)
    record = tmp_path / "argv.txt"
    path = f"{tmp_path}{os.pathsep}{os.environ['PATH']}"
    run_env = {**env, **PROXIES, "PATH": path, "RECORD": str(record), "OUTPUT_DIR": str(tmp_path)}
    root = CONFIGS_DIR.parent
    subprocess.run(["bash", str(root / "scripts" / script)], cwd=root, env=run_env, check=True)
    return record.read_text().splitlines()


def _without_proxies(argv: list[str], tmp_path) -> bool:
    """Whether train.py starts without the proxy variables: not in the launcher's environment
    (srun hands it on), or removed on each rank (`env -u NAME ... python`)."""
    passed = (tmp_path / "argv.txt.proxies").read_text().split()
    cut = argv[: argv.index("python")]
    removed = {cut[i + 1] for i, a in enumerate(cut) if a == "-u" and "env" in cut[:i]}
    return all(
        f"{name}={value}" not in passed or name in removed for name, value in PROXIES.items()
    )


@pytest.mark.parametrize(
    "script, launcher, env, launcher_env",
    [
        (
            "slurm_train.sbatch",
            "srun",
            {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NAME": "t", "SLURM_JOB_ID": "4242"},
            SLURM,
        ),
        (
            "mpirun_train.sh",
            "mpirun",
            {"HOSTS": "node1,node2"},
            {k: v for k, v in OPEN_MPI.items() if k != "OMPI_MCA_orte_hnp_uri"},  # Open MPI 5
        ),
    ],
)
def test_example_scripts_give_one_pipeline_group_per_node(
    tmp_path, script, launcher, env, launcher_env
):
    """scripts/: each node one process and one pipeline group over its 8 GPUs, as the launcher
    (faked: it records its arguments) would start train.py."""
    argv = _script_argv(tmp_path, script, launcher, env)
    assert ("--ntasks-per-node=1" if launcher == "srun" else "--npernode") in argv
    config = load_config(argv[argv.index("train.py") + 1 :])
    assert config.hardware == "gpu_multiprocess" and config.processes_pending
    procs = processes.for_config(config, launcher_env)
    resolved = config.resolve_devices(
        16,
        coordinator_address=procs.coordinator_address,
        num_processes=procs.num_processes,
        process_id=procs.process_id,
    )
    assert (resolved.num_processes, resolved.mesh_pipeline, resolved.mesh_fsdp) == (2, 2, 8)
    assert resolved.num_devices == 16 and resolved.dcn_pipeline_parallelism == 2
    # gRPC to the coordinator hangs behind an HTTP proxy: train.py starts without one
    assert _without_proxies(argv, tmp_path)
    if launcher == "mpirun":  # a port free on this (the first) host, or PORT=
        host, port = resolved.coordinator_address.split(":")
        assert host == "node1" and 1024 <= int(port) < 65536 and int(port) != 12355
        again = _script_argv(tmp_path, script, launcher, {**env, "PORT": "4321"})
        assert "coordinator_address=node1:4321" in again


def test_the_two_node_smoke_script(tmp_path):
    """scripts/gpu_smoke_two_nodes.sbatch (fake `srun` and `scontrol`): without proxies, it
    times a transfer between the nodes with the first node as coordinator (on a port apart
    from the trainer's) and each task's SLURM_PROCID as its process, then trains one pipeline
    group per node."""
    import subprocess

    calls = tmp_path / "calls.txt"
    (tmp_path / "srun").write_text(
        '#!/bin/bash\nprintf "%s\\n" "$@" "--" >> "$RECORD"\n'
        'env | grep -i "_proxy=" >> "$RECORD.proxies" || true\n'
    )
    (tmp_path / "scontrol").write_text("#!/bin/bash\nprintf 'gpu017\\ngpu018\\n'\n")
    for name in ("srun", "scontrol"):
        (tmp_path / name).chmod(0o755)
    env = {
        **PROXIES,
        "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
        "RECORD": str(calls),
        "SLURM_JOB_NODELIST": "gpu[017-018]",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "t",
        "OUTPUT_DIR": str(tmp_path),
        "LINK_GBPS": "3200",
    }
    root = CONFIGS_DIR.parent
    script = root / "scripts" / "gpu_smoke_two_nodes.sbatch"
    subprocess.run(["bash", str(script)], cwd=root, env=env, check=True)
    assert (tmp_path / "calls.txt.proxies").read_text() == ""
    first, second, _ = calls.read_text().split("--\n")
    transfer = " ".join(first.splitlines()[-1].split())
    assert transfer == (  # port 61440 + (4242 + 1) mod 4096
        "exec python benchmarks/gpu_transfer.py --coordinator gpu017:61587 --num-processes 2 "
        "--process-id $SLURM_PROCID --link-gbps 3200"
    )
    argv = second.splitlines()
    config = load_config(argv[argv.index("train.py") + 1 :])
    assert config.hardware == "gpu_multiprocess" and config.dcn_pipeline_parallelism == 2
