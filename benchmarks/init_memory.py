"""Device memory of a fresh pipelined run's initialisation at real scale, on abstract inputs.

Run from the repository root (about 3 minutes on 2 CPU cores; nothing is allocated):

    . .venv/bin/activate && python benchmarks/init_memory.py

A fresh run initialises its state with the two programs of `MaxText.train_step.init_programs` on
this process's first pipeline group: `canonical` (every layer's parameters, stacked) and `layout`
(the whole state in the training layout: parameters, Adam's two moments, the step). The first
step then moves each stage's share to its own group. This compiles both programs for Llama 2 70B
at pipeline_parallelism=8 x ici_fsdp_parallelism=8 (issue 37's plan, which fits an H100 for the
step: benchmarks/results/plan_llama.json) on 64 emulated CPU devices and reads their
`memory_analysis()` per device. While `layout` runs, its argument (the canonical parameters) and
its output (the whole state) are both live on each of group 0's 8 devices. Writes
`benchmarks/results/init_memory.json` and prints a markdown table.

It also measures a fine-tune's start (`load_parameters_path`) at the same layout: the parameters
are read onto the groups that use them, and the rest of the state (step 0, Adam's moments) is
made by one program per group holding only that group's leaves
(`MaxText.checkpoint.manager.Checkpoints._state_around`). That needs the pipelined trainer built
(the 70B step compiled on abstract inputs, about 2 minutes here), to know which group reads each
leaf; each group's program is compiled and its outputs per device read, and added to the
group's share of the loaded parameters.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=64"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import datetime  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

from MaxText import sharding  # noqa: E402
from MaxText import train_step as ts  # noqa: E402
from MaxText.config import CONFIGS_DIR, load_config  # noqa: E402
from MaxText.model import Decoder  # noqa: E402
from MaxText.optimizer import make_optimizer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
KEYS = [
    "model_name=llama2-70b",
    "pipeline_parallelism=8",
    "ici_fsdp_parallelism=8",
    "global_batch_size=128",
    "num_pipeline_microbatches=16",
]
H100_BYTES = 80e9


def measure(keys: list[str]) -> dict:
    config = load_config([str(CONFIGS_DIR / "base.yml"), *keys])
    mesh = sharding.make_mesh(config, jax.devices()[: config.num_devices])
    first_group = sharding.make_mpmd_mesh(mesh).unstack[0]
    model = Decoder(config)
    optimizer, _ = make_optimizer(config)
    abstract_state, specs = ts.state_specs(config, model, optimizer)
    canonical, layout, _ = ts.init_programs(first_group, config, model, optimizer, specs)
    rng = jax.random.key(0)
    with sharding.axis_rules():
        canonical_exe = canonical.lower(rng).compile()
        canonical_out = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            jax.eval_shape(canonical, rng),
            canonical_exe.output_shardings,
        )
        layout_exe = layout.lower(rng, canonical_out).compile()
    rows = {}
    for name, exe in (("canonical", canonical_exe), ("layout", layout_exe)):
        m = exe.memory_analysis()
        rows[name] = {
            "argument_bytes": m.argument_size_in_bytes,
            "output_bytes": m.output_size_in_bytes,
            "temp_bytes": m.temp_size_in_bytes,
            "peak_bytes": m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes,
        }
    state_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(abstract_state))
    return {
        "keys": keys,
        "devices_of_group_0": int(first_group.devices.size),
        "state_bytes_total": int(state_bytes),
        "programs_per_device": rows,
        "peak_bytes_per_device": max(r["peak_bytes"] for r in rows.values()),
        "h100_bytes": H100_BYTES,
    }


def measure_fine_tune(keys: list[str]) -> dict:
    """Per group: device bytes of the loaded parameters and of the program making the rest of
    the state there (outputs and temporaries, per device)."""
    from jax.sharding import NamedSharding

    from MaxText.checkpoint.layout import placement_for
    from MaxText.checkpoint.manager import initial_state_leaves

    config = load_config([str(CONFIGS_DIR / "base.yml"), *keys])
    mesh = sharding.make_mesh(config, jax.devices()[: config.num_devices])
    trainer = ts.build_trainer(config, mesh)
    abstract = jax.tree.leaves(trainer.abstract_state)
    placement = placement_for(trainer, abstract)
    flat = jax.tree_util.tree_flatten_with_path(trainer.abstract_state)[0]
    is_param = [getattr(path[0], "key", None) == "params" for path, _ in flat]
    others = [j for j, p in enumerate(is_param) if not p]
    values = initial_state_leaves(trainer.abstract_state, trainer.optimizer)

    def bytes_per_device(j: int, r: int) -> int:
        a = abstract[j]
        shard = NamedSharding(trainer.mpmd_mesh.unstack[r], placement.specs[j]).shard_shape(a.shape)
        n = 1
        for d in shard:
            n *= d
        return n * a.dtype.itemsize

    groups = {}
    for r, (_held, program) in placement.programs(values, others).items():
        m = program.lower().compile().memory_analysis()
        params = sum(
            bytes_per_device(j, r) for j, p in enumerate(is_param) if p and r in placement.groups[j]
        )
        made = m.output_size_in_bytes + m.temp_size_in_bytes
        groups[str(r)] = {"params_bytes": params, "made_bytes": made, "peak_bytes": params + made}
    return {
        "keys": keys,
        "groups": groups,
        "peak_bytes_per_device": max(g["peak_bytes"] for g in groups.values()),
    }


def main() -> None:
    result = measure(KEYS)
    result["fine_tune"] = measure_fine_tune(KEYS)
    result["date"] = datetime.date.today().isoformat()
    out = REPO / "benchmarks" / "results" / "init_memory.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    gb = lambda b: f"{b / 1e9:.1f}"  # noqa: E731
    print("| program | arguments GB | outputs GB | temporaries GB | peak GB / device |")
    print("|---|---|---|---|---|")
    for name, r in result["programs_per_device"].items():
        print(
            f"| {name} | {gb(r['argument_bytes'])} | {gb(r['output_bytes'])} | "
            f"{gb(r['temp_bytes'])} | {gb(r['peak_bytes'])} |"
        )
    print(f"whole state {gb(result['state_bytes_total'])} GB; H100 {gb(H100_BYTES)} GB per device")
    print(
        "\n| fine-tune, group | loaded parameters GB | made (moments, step) GB | peak GB / device |"
    )
    print("|---|---|---|---|")
    for r, g in result["fine_tune"]["groups"].items():
        print(f"| {r} | {gb(g['params_bytes'])} | {gb(g['made_bytes'])} | {gb(g['peak_bytes'])} |")


if __name__ == "__main__":
    main()
