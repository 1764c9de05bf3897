"""The printed report of benchmarks/engine_overhead.py: step time against `jax.jit`, host dispatch
per task instance, compile time (the JSON result holds the same figures)."""

from __future__ import annotations


def print_steps(info, steps, schedules, goals):
    ms = lambda s: f"{s * 1e3:8.1f} ms"  # noqa: E731
    sm, sr = steps["median_s"], steps["ratio_vs_jit"]
    print()
    print(
        f"machine: {info['cpu_count']} CPUs ({info['cpu_model'] or 'unknown model'}), "
        f"jax {info['jax']}, {info['num_devices']} emulated CPU devices, "
        f"load avg {info['loadavg_start'][0]:.1f} -> {info['loadavg_end'][0]:.1f}, "
        f"{info['date']}"
    )
    print()
    print(
        f"{'1. step time (median)':34s} {'time':>11s} {'/ jit':>7s} {'round ratio':>12s} "
        f"{'serialized tasks':>17s}   (/ jit: median of {steps['repeats']} repeats)"
    )
    print(f"{'  jit_1dev  (1 device)':34s} {ms(sm['jit_1dev'])} {'1.00':>7s}")
    for n in schedules:
        label = f"  {n} ({schedules[n][0]} device{'s' if schedules[n][0] > 1 else ''})"
        print(
            f"{label:34s} {ms(sm[n])} {sr[n]:7.2f} "
            f"{steps['median_round_ratio_vs_jit'][n]:12.2f} "
            f"{ms(steps['serialized_task_sum_s'][n]):>17s}"
        )
    print(
        "  repeats / jit: "
        + "; ".join(
            f"{n} " + ", ".join(f"{r:.2f}" for r in steps["repeat_ratios_vs_jit"][n])
            for n in schedules
        )
    )
    print(
        f"  goals: mpmd_1group / jit <= {goals['step_ratio_1group']}, "
        f"mpmd_4groups / jit <= {goals['step_ratio']} "
        f"(see README: on 2 shared CPU cores 4 groups cannot beat 1 device)"
    )


def print_dispatch(dispatch, goals):
    d = dispatch
    c = d["instructions"]
    print(
        f"2. host dispatch, tiny model, mpmd_4groups: {c['run']} tasks, {c['transfer']} "
        f"transfers, {c['fill']} fills, {c['delete']} deletes (folded into releases) per step"
    )
    print(
        f"  whole step               {d['step_median_s'] * 1e3:7.2f} ms  -> "
        f"{d['us_per_task_instance']:6.1f} us/task instance (median of "
        f"{len(d['us_per_task_instance_per_repeat'])} repeats: "
        + ", ".join(f"{x:.1f}" for x in d["us_per_task_instance_per_repeat"])
        + f"), {d['us_per_instruction']:5.1f} us/instruction"
    )
    print(
        f"  same step, CPU time of the calling thread only: "
        f"{d['step_calling_thread_cpu_median_s'] * 1e3:.2f} ms -> "
        f"{d['cpu_us_per_task_instance']:6.1f} us/task instance"
    )
    print(
        f"  runtime.execute walk     {d['execute_walk_median_s'] * 1e3:7.2f} ms  -> "
        f"{d['walk_us_per_task_instance']:6.1f} us/task instance, "
        f"{d['walk_us_per_instruction']:5.1f} us/instruction"
    )
    b = d["walk_breakdown_median_ms"]
    print(
        f"  split of a separately timed walk ({d['breakdown_walk_median_ms']:.2f} ms): "
        f"{b['in_task_executables']:.2f} ms in {c['run']} task calls, "
        f"{b['in_transfers']:.2f} ms in {c['transfer']} transfers, "
        f"{b['deletes_and_bookkeeping']:.2f} ms releases + bookkeeping "
        f"({d['engine_own_us_per_task_instance']:.1f} us/task instance)"
    )
    print(
        f"  JAX floor: bare call of one task executable {d['bare_executable_call_us']:.1f} us, "
        f"bare cross-group device_put {d['bare_transfer_us']:.1f} us "
        f"(the runtime's copy_shards {d['bare_copy_shards_us']:.1f} us)"
    )
    print(f"  goal: <= {goals['dispatch_us_per_task']:.0f} us per task instance")


def print_compile(compile_, variants, goals):
    cm, cc = compile_["median_s"], compile_["median_cpu_s"]
    print("3. compile time (median, after jax.clear_caches()); wall and process CPU time")
    print(f"  {'jit_1dev':22s} {cm['jit_1dev']:6.2f} s  cpu {cc['jit_1dev']:6.2f} s")
    for n in variants:
        st = compile_["mpmd_compile_stats"][n]
        print(
            f"  {n:22s} {cm[n]:6.2f} s  = {compile_['ratio_vs_jit'][n]:.2f} x jit  "
            f"cpu {cc[n]:6.2f} s = {compile_['cpu_ratio_vs_jit'][n]:.2f} x  "
            f"({st['xla_compiles']} XLA compiles + {st['loaded']} loaded for "
            f"{compile_['mpmd_num_executables'][n]} executables, "
            f"{compile_['mpmd_task_xla_compile_median_s'][n]:.2f} s in compile_program)"
        )
    print(f"  goal: <= {goals['compile_ratio']} x")
