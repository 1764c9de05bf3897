"""Mesh keys of the config: the ici_* and dcn_* parallelism axes and MaxText's -1 ("the rest").

`derive_mesh(values)` fills a -1 dcn axis from `num_processes`, checks the products and sets the
mesh sizes; `fill_axes` fills a -1 among some axes from a total, which `Config.resolve_devices`
uses for the ici axes once the devices are known. Errors are `ConfigError`s naming the keys and
the values that would work.
"""

from __future__ import annotations

import math
from typing import Any

from MaxText.errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor", "pipeline")  # ici x dcn per axis -> Config.mesh_<axis>
# Axes inside one process only (no dcn_ key): experts are dispatched with all-to-all, which
# wants the fast links (dcn_expert_parallelism is a later issue).
ICI_ONLY_AXES = ("expert",)
PARALLELISM_KEYS = tuple(f"ici_{axis}_parallelism" for axis in (*MESH_AXES, *ICI_ONLY_AXES))
DCN_KEYS = tuple(f"dcn_{axis}_parallelism" for axis in MESH_AXES)


def _divisors(n: int) -> str:
    ds = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ", ".join(ds[:-1]) + " or " + ds[-1] if len(ds) > 1 else ds[0]


def filled_axis(values: dict[str, int]) -> list[str]:
    """The key among `values` that is -1 (at most one may be)."""
    fill = [k for k, v in values.items() if v == -1]
    if len(fill) > 1:
        raise ConfigError(f"only one parallelism axis may be -1, got {', '.join(fill)}")
    return fill


def fill_axes(values: dict[str, int], total: int, what: str) -> dict[str, int]:
    """{the -1 key: the value that makes the product of `values` equal `total`} ({} if none)."""
    fill = filled_axis(values)
    if not fill:
        return {}
    others = {k: v for k, v in values.items() if k != fill[0]}
    product = math.prod(others.values())
    if total % product:
        named = " x ".join(f"{k}={v}" for k, v in others.items() if v > 1) or "1"
        raise ConfigError(
            f"{named} needs a multiple of {product} {what} but {total} {what} are "
            f"available; use a product that divides {total} ({_divisors(total)})"
        )
    return {fill[0]: total // product}


def derive_mesh(v: dict[str, Any]) -> None:
    """The dcn axes span the processes (their product is num_processes, one may be -1), the ici
    axes the devices of one process, as MaxText's hybrid mesh does across slices. Sets
    `mesh_<axis>`, `num_devices` and `data_parallel_devices`."""
    v.update(fill_axes({k: v[k] for k in DCN_KEYS}, v["num_processes"], "processes"))
    dcn = math.prod(v[k] for k in DCN_KEYS)
    if dcn > 1 and dcn != v["num_processes"]:
        product = " x ".join(f"{k}={v[k]}" for k in DCN_KEYS if v[k] > 1)
        raise ConfigError(
            f"{product} spans {dcn} processes but num_processes={v['num_processes']}; "
            f"the dcn axes split the processes, so their product must be num_processes"
        )
    for axis in MESH_AXES:
        v[f"mesh_{axis}"] = v[f"ici_{axis}_parallelism"] * v[f"dcn_{axis}_parallelism"]
    for axis in ICI_ONLY_AXES:
        v[f"mesh_{axis}"] = v[f"ici_{axis}_parallelism"]
    # the batch is split over data, fsdp and expert (experts are split over expert alone)
    v["data_parallel_devices"] = v["mesh_data"] * v["mesh_fsdp"] * v["mesh_expert"]
    v["num_devices"] = v["data_parallel_devices"] * v["mesh_tensor"] * v["mesh_pipeline"]
    if v["mesh_pipeline"] > 1 and dcn > v["dcn_pipeline_parallelism"]:
        raise ConfigError(
            "a pipelined run keeps each pipeline group on one process, so dcn_data/fsdp/tensor_"
            "parallelism must be 1; split the processes with dcn_pipeline_parallelism instead"
        )
    tp = v["mesh_tensor"]
    moe_keys = ("moe_mlp_dim",) if v["num_experts"] > 1 else ()
    for key in ("num_query_heads", "num_kv_heads", "mlp_dim", "vocab_size", *moe_keys):
        if v[key] % tp:
            raise ConfigError(
                f"{key}={v[key]} is not divisible by tensor parallelism {tp}; "
                f"tensor parallelism splits it across devices"
            )
    if v["emb_dim"] % v["mesh_fsdp"]:
        raise ConfigError(
            f"emb_dim={v['emb_dim']} is not divisible by fsdp parallelism {v['mesh_fsdp']}; "
            f"fsdp shards parameters along it"
        )
    _expert_axis(v)


# exact integers of each 16-bit dtype: the dispatch sends each slot's expert as a number
_EXACT_IDS = {"bfloat16": 256, "float16": 2048}


def _expert_axis(v: dict[str, Any]) -> None:
    ep, experts = v["mesh_expert"], v["num_experts"]
    if ep > 1 and experts == 1:
        raise ConfigError(
            f"ici_expert_parallelism={ep} splits the experts of a mixture-of-experts model, but "
            "num_experts=1 (a dense model); set num_experts > 1 or ici_expert_parallelism=1"
        )
    if experts % ep:
        raise ConfigError(
            f"num_experts={experts} is not divisible by ici_expert_parallelism={ep}; each "
            f"device holds num_experts / {ep} experts: use {_divisors(experts)}"
        )
    limit = _EXACT_IDS.get(v["dtype"])
    if ep > 1 and limit and experts // ep > limit:
        raise ConfigError(
            f"num_experts={experts} / ici_expert_parallelism={ep} = {experts // ep} experts per "
            f"device exceeds {limit}, the largest expert id dtype={v['dtype']} carries exactly "
            f"in the dispatch; raise ici_expert_parallelism to {-(-experts // limit)} or more"
        )
