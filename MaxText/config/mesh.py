"""Mesh keys of the config: the ici_* and dcn_* parallelism axes, and MaxText's -1 ("the rest").

`resolve_parallelism(values, available_devices)` fills the one -1 axis of each kind from the
devices (ici) or processes (dcn) there are, and checks the products; every error is a
`ConfigError` naming the keys and the values that would work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from MaxText.errors import ConfigError

PARALLELISM_KEYS = (
    "ici_data_parallelism",
    "ici_fsdp_parallelism",
    "ici_tensor_parallelism",
    "ici_pipeline_parallelism",
)

DCN_KEYS = (
    "dcn_data_parallelism",
    "dcn_fsdp_parallelism",
    "dcn_tensor_parallelism",
    "dcn_pipeline_parallelism",
)


def _divisors(n: int) -> str:
    ds = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ", ".join(ds[:-1]) + " or " + ds[-1] if len(ds) > 1 else ds[0]


def _fill_one(values: dict[str, Any], keys: Sequence[str], total: int, what: str) -> None:
    """Sets the one -1 among `keys` so that their product is `total` (MaxText's convention)."""
    for key in keys:
        if values[key] == 0 or values[key] < -1:
            raise ConfigError(f"{key}={values[key]}: must be >= 1 (or -1 for 'the rest')")
    fill = [k for k in keys if values[k] == -1]
    if len(fill) > 1:
        raise ConfigError(f"only one parallelism axis may be -1, got {', '.join(fill)}")
    if not fill:
        return
    others = [k for k in keys if k != fill[0]]
    product = 1
    for k in others:
        product *= values[k]
    if total % product:
        named = " x ".join(f"{k}={values[k]}" for k in others if values[k] > 1) or "1"
        raise ConfigError(
            f"{named} needs a multiple of {product} {what} but {total} {what} are "
            f"available; use a product that divides {total} ({_divisors(total)})"
        )
    values[fill[0]] = total // product


def resolve_parallelism(values: dict[str, Any], available_devices: int | None) -> None:
    """Fills a -1 parallelism axis with the remaining devices (MaxText's convention).

    Without dcn axes the ici axes span every device of every process. With a dcn_*_parallelism
    > 1 the dcn axes span the processes (their product is num_processes) and the ici axes the
    devices of one process, as MaxText's hybrid mesh does across slices.
    """
    _fill_one(values, DCN_KEYS, values["num_processes"], "processes")
    dcn = 1
    for key in DCN_KEYS:
        dcn *= values[key]
    if dcn > 1 and dcn != values["num_processes"]:
        product = " x ".join(f"{k}={values[k]}" for k in DCN_KEYS if values[k] > 1)
        raise ConfigError(
            f"{product} spans {dcn} processes but num_processes={values['num_processes']}; "
            f"the dcn axes split the processes, so their product must be num_processes"
        )
    if all(values[k] != -1 for k in PARALLELISM_KEYS):
        _fill_one(values, PARALLELISM_KEYS, 1, "devices")  # checks the values only
        return
    if available_devices is None:
        from MaxText.cluster import devices  # deferred: probing devices initialises JAX's backends

        available_devices = devices.available_device_count(
            values["coordinator_address"], values["num_processes"], values["process_id"]
        )
    _fill_one(values, PARALLELISM_KEYS, available_devices // dcn, "devices")
