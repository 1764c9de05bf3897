#!/bin/bash
# Train with Open MPI: one process per host, each owning every GPU of its host (a pipeline group
# lives inside one process). Run from the repository on the first host:
#
#   HOSTS=node1,node2 scripts/mpirun_train.sh [key=value ...]
#
# The line it runs, for two hosts:
#   mpirun -np 2 --host node1,node2 --npernode 1 --bind-to none -x PATH -x LD_LIBRARY_PATH \
#       env -u http_proxy -u https_proxy ... python train.py configs/base.yml \
#       hardware=gpu_multiprocess num_processes=-1 coordinator_address=node1:<free port> \
#       dcn_pipeline_parallelism=2 ici_fsdp_parallelism=-1 ...
#
# num_processes=-1: the process count and this process's rank come from mpirun
# (OMPI_COMM_WORLD_SIZE / _RANK). coordinator_address names process 0's host and a port: Open
# MPI 5 does not export where it runs (Open MPI 4 does, and the key may then be left out). The
# port is one free on this host (run this on the first host, where process 0 runs; PORT=
# chooses one), not a fixed number another job may hold. Every rank runs without
# http_proxy / https_proxy: gRPC to the coordinator honours them and hangs behind a proxy.
# See docs/cluster.md, "Running on a GPU cluster".
set -euo pipefail
HOSTS="${HOSTS:?set HOSTS=node1,node2,... (one process per host)}"
FIRST="${HOSTS%%,*}"
N=$(tr ',' '\n' <<<"$HOSTS" | grep -c .)
if [ -z "${PORT:-}" ]; then  # a port the kernel reports free here
  PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
fi

exec mpirun -np "$N" --host "$HOSTS" --npernode 1 --bind-to none \
    -x PATH -x LD_LIBRARY_PATH \
    env -u http_proxy -u https_proxy -u HTTP_PROXY -u HTTPS_PROXY -u all_proxy -u ALL_PROXY \
    python train.py configs/base.yml \
    hardware=gpu_multiprocess \
    num_processes=-1 \
    coordinator_address="${FIRST}:${PORT}" \
    dcn_pipeline_parallelism="$N" \
    ici_fsdp_parallelism=-1 \
    model_name=gpt3-1.3b \
    base_output_directory="${OUTPUT_DIR:-$PWD/outputs}" \
    "$@"
