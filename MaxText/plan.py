"""Plans a run before launch: does the config fit, per pipeline group, and how fast will it be?

    python -m MaxText.plan configs/base.yml [key=value ...] [--hardware h100|h200|a100|cpu]
                           [--json FILE]

It plans the config as `train.py` would run it (`MaxText.planning.cost_model`: the trainer's real
step compiled on abstract inputs, no parameter memory), with every `auto` key decided as the trainer
decides it (`MaxText.planning.auto`), and prints per pipeline group and per device: parameters,
optimizer state, gradient accumulators, peak activations, XLA temporaries and the total peak
(a GPU plan that does not fit by XLA:CPU's temporaries is judged by the per-layer bound where
that is smaller, and says so: `MaxText.planning.layer_bound`);
then the predicted step time, bubble and MFU, the stage split (even vs auto side by side) and the
remat policy of each stage. A mixture of experts adds a line (`moe_report.describe_moe`) and is
planned for a GPU preset with its GPU kernel (`moe_matmul=auto` is `ragged_dot` there).

Exit code 0 when every group fits the hardware's memory, 1 with one line per group that does not
(and concrete suggestions), 2 for a config error, a hardware flag out of range (`--memory-gb`,
`--peak-tflops`, `--hbm-gbps`, `--link-gbps`, `--ici-gbps` must be > 0, `--efficiency` in
(0, 1]) or a `--json` file that cannot be written (checked before anything is compiled).
`--json` writes the plan as data (see `Plan`). Exit codes: `MaxText/exit_codes.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from MaxText import exit_codes
from MaxText.cluster.compile_cache import compilation_cache
from MaxText.cluster.output_paths import writable_file
from MaxText.planning.auto import describe_remat, make_plan, resolve_schedule
from MaxText.planning.cost_model import Plan, describe_gradients
from MaxText.planning.hardware import GB, HARDWARE, byte_unit, cpu_hardware, format_bytes
from MaxText.planning.layer_bound import describe as describe_bound
from MaxText.planning.moe_report import describe_moe


def format_plan(plan: Plan) -> str:
    scale, name = byte_unit(max(g.peak_bytes for g in plan.groups))
    rows = [
        f"plan for {plan.hardware} ({format_bytes(plan.memory_bytes)} per device): "
        f"schedule {plan.schedule}, {plan.num_microbatches} microbatches"
        + (f", stages of {plan.stage_layers} layers" if plan.stage_layers else ""),
        f"{'group':>5} {'params':>9} {'optim':>9} {'grads':>9} {'activ':>9} {'temp':>9} "
        f"{'peak':>9}  ({name} per device)",
    ]
    for g in plan.groups:
        cells = (
            g.params_bytes,
            g.optimizer_bytes,
            g.grad_bytes,
            g.activation_bytes,
            g.temp_bytes,
            g.peak_bytes,
        )
        mark = "" if g.peak_bytes <= plan.memory_bytes else "  does not fit"
        rows.append(f"{g.group:>5} " + " ".join(f"{c / scale:9.2f}" for c in cells) + mark)
    p = plan.predicted
    rows.append(
        f"predicted step {p['step_time_s']:.3f} s, bubble {100 * p['bubble']:.1f}%, "
        f"MFU {100 * p['mfu']:.1f}%"
    )
    if plan.layer_bound is not None:
        xla = [g.xla_temp_bytes or g.temp_bytes for g in plan.groups]
        rows += describe_bound(plan.layer_bound, plan.hardware, xla, format_bytes)
    if plan.gradients is not None:
        rows.append(describe_gradients(plan.gradients))
    if plan.moe is not None:
        rows.append(describe_moe(plan.moe))
    if plan.remat is not None:
        rows.append(describe_remat(plan.remat))
    elif plan.stage_remat and len(set(plan.stage_remat)) > 1:
        rows.append(f"remat per stage {list(plan.stage_remat)}")
    if plan.compared is not None:
        rows.append("stage split, even vs auto:")
        even_time = plan.compared.predicted["step_time_s"]
        for label, q in (("even", plan.compared), ("auto", plan)):
            t = q.predicted["step_time_s"]
            rows.append(
                f"  {label}: layers {','.join(map(str, q.stage_layers))}; remat "
                f"{','.join(q.stage_remat)}; step {t:.3f} s ({even_time / t:.2f}x); largest "
                f"peak {format_bytes(max(g.peak_bytes for g in q.groups))}"
                + ("" if q.fits else " (does not fit)")
            )
    return "\n".join(rows)


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _parser() -> exit_codes.ArgumentParser:
    from MaxText.config import tool_help

    parser = exit_codes.ArgumentParser(
        prog="python -m MaxText.plan",
        usage=tool_help.usage("MaxText.plan"),
        description=tool_help.TOOLS["MaxText.plan"].about,
        add_help=True,
    )
    hw = "predict for this hardware preset (memory, peak, bandwidths)"
    parser.add_argument("--hardware", default="h100", choices=[*HARDWARE, "cpu"], help=hw)
    parser.add_argument("--json", dest="json_path", default=None, help="also write the plan here")
    overrides = {
        "memory-gb": "device memory, GB",
        "peak-tflops": "dense bf16 peak per device, TFLOP/s",
        "hbm-gbps": "device memory bandwidth, GB/s",
        "link-gbps": "stage-to-stage bandwidth per device, GB/s",
        "ici-gbps": "bandwidth per device inside a group (NVLink), GB/s: the MoE all-to-all",
    }
    for flag, what in overrides.items():
        parser.add_argument(f"--{flag}", type=_positive, default=None, help=f"{what} (> 0)")
    what = "fraction of the peak a large matmul-bound task reaches, in (0, 1]"
    parser.add_argument("--efficiency", type=_fraction, default=None, help=what)
    return parser


def main(argv=None) -> int:
    from MaxText.config import tool_help

    argv = list(sys.argv[1:] if argv is None else argv)
    if (words := tool_help.requested(argv)) is not None:  # --help [WORD]: flags and keys
        return tool_help.show("MaxText.plan", words, _parser().format_help())
    args, rest = _parser().parse_known_args(argv)  # a bad flag: one `usage error:` line, exit 2
    return exit_codes.run(lambda: _plan(args, rest))


def _plan(args, rest) -> int:
    from MaxText.metrics import setup_logging

    setup_logging()
    from MaxText.cluster import devices, xla_flags
    from MaxText.config import load_config

    config = load_config(rest)
    if args.json_path:
        writable_file(args.json_path, "--json")
    xla_flags.apply_gpu_defaults(config.hardware)  # a GPU plan compiles as the trainer does
    config, _ = devices.start(config)
    hardware = HARDWARE.get(args.hardware) or cpu_hardware(config.num_devices)
    if config.is_moe and config.moe_matmul == "auto" and args.hardware in HARDWARE:
        # plan the program a GPU runs (`moe_matmul=auto` is ragged_dot there), not this host's
        config = config.replace(moe_matmul="ragged_dot")
    overrides = {
        "memory_bytes": args.memory_gb and args.memory_gb * GB,
        "peak_tflops": args.peak_tflops,
        "hbm_gbps": args.hbm_gbps,
        "link_gbps": args.link_gbps,
        "ici_gbps": args.ici_gbps,
        "efficiency": args.efficiency,
    }
    hardware = dataclasses.replace(
        hardware, **{k: v for k, v in overrides.items() if v is not None}
    )
    with compilation_cache(config.jax_cache_dir):
        config, base = resolve_schedule(config, hardware)
        plan = make_plan(config, hardware, base)
    print(format_plan(plan))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(plan.as_json(), f, indent=1)
    problems = plan.problems()
    for line in problems:
        print(line, file=sys.stderr)
    return exit_codes.OK if plan.fits else exit_codes.RUN_FAILURE


if __name__ == "__main__":
    sys.exit(main())
