"""benchmarks/sweep.py: the grid, skipped points, metrics reading, and a real 1-point sweep.

The 1-point sweep runs the real trainer (tiny preset, shrunk further, synthetic data) for one
pipelined point in a subprocess (~30 s here) and checks the CSV and both plots; it asserts that
what was measured exists and is consistent (positive step time, bubble equal to the formula),
never how fast anything is.
"""

import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _load_sweep():
    spec = importlib.util.spec_from_file_location("sweep", REPO / "benchmarks" / "sweep.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["sweep"] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


sweep = _load_sweep()
SMALL = [
    "model_name=tiny",
    "dataset_type=synthetic",
    "num_decoder_layers=2",
    "emb_dim=32",
    "head_dim=8",
    "mlp_dim=64",
    "max_target_length=16",
    "per_device_batch_size=4",
]


def _points(tmp_path, *extra):
    args = sweep.parse_args(
        ["configs/base.yml", *SMALL, "--runs-dir", str(tmp_path / "runs"), *extra]
    )
    points = sweep.make_points(args)
    reasons = {}
    for p in points:
        p.argv = sweep.point_argv(args, p, f"t_{p.name}")
        reasons[p.name] = sweep.validate(p)
    return args, points, reasons


def test_grid_baseline_and_skipped_points(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    _, points, reasons = _points(
        tmp_path,
        "--pipeline-parallelism",
        "2,4",
        "--schedules",
        "1f1b,interleaved_1f1b",
        "--microbatches",
        "2,4",
    )
    names = [p.name for p in points]
    assert names[:2] == ["pp1_spmd_m2", "pp1_spmd_m4"]  # baseline added, once per microbatches
    assert len(names) == 2 + 2 * 2 * 2
    assert reasons["pp2_1f1b_m2"] is None and reasons["pp1_spmd_m4"] is None
    # interleaved with 2 virtual stages on 4 groups needs 8 stages; only 2 layers
    assert "less than the 8 pipeline stages" in reasons["pp4_interleaved_1f1b_v2_m4"]
    # pp=4 on 2 layers is invalid for every schedule
    assert "less than the 4 pipeline stages" in reasons["pp4_1f1b_m4"]
    row = next(p.row for p in points if p.name == "pp2_1f1b_m4")
    assert row["simulated_bubble"] == pytest.approx((2 - 1) / (4 + 2 - 1))  # (p-1)/(m+p-1)
    assert row["simulated_peak_live_activations"] == "2;1"


def test_interleaved_needs_microbatches_multiple_of_groups(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    _, points, reasons = _points(
        tmp_path,
        *("--pipeline-parallelism", "2", "--schedules", "interleaved_1f1b"),
        *("--microbatches", "1,2", "--interleaved-repeats", "1", "--no-baseline"),
    )
    assert [p.name for p in points] == ["pp2_interleaved_1f1b_m1", "pp2_interleaved_1f1b_m2"]
    assert "to be a multiple of ici_pipeline_parallelism=2" in reasons["pp2_interleaved_1f1b_m1"]
    assert reasons["pp2_interleaved_1f1b_m2"] is None


def test_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        sweep.parse_args(["configs/base.yml", "--schedules", "1f1b,zigzag"])
    assert "unknown schedule 'zigzag'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sweep.parse_args(["configs/base.yml", "num_pipeline_microbatches=8"])
    assert "use --microbatches" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sweep.parse_args(["configs/base.yml", "--microbatches", "4,x"])


def test_read_metrics_skips_warmup_and_last_step(tmp_path):
    lines = [
        {"step": s, "loss": 5.0 - s, "step_time_s": t, "tokens_per_s_per_device": 100 / t,
         "tflops_per_s_per_device": 1 / t, "mfu": 0.1 / t}
        for s, t in [(1, 9.0), (2, 3.0), (3, 1.0), (4, 2.0), (5, 4.0), (6, 0.001)]
    ]  # fmt: skip
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    got = sweep.read_metrics(path, warmup=2, steps=3)
    assert got["timed_steps"] == 3 and got["step_time_s"] == 2.0  # steps 3, 4, 5
    assert got["step_time_min_s"] == 1.0
    assert got["tokens_per_s_per_device"] == pytest.approx(50.0)
    assert got["mfu"] == pytest.approx(0.05)
    assert got["final_loss"] == -1.0


def test_one_point_sweep(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    out = tmp_path / "results"
    code = sweep.main(
        [
            "configs/base.yml",
            *SMALL,
            "--pipeline-parallelism",
            "2",
            "--schedules",
            "1f1b",
            "--microbatches",
            "2",
            "--no-baseline",
            "--warmup",
            "1",
            "--steps",
            "1",
            "--out",
            str(out),
            "--runs-dir",
            str(tmp_path / "runs"),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert [r["point"] for r in rows] == ["pp2_1f1b_m2"]
    row = rows[0]
    assert row["status"] == "ok", row["reason"]
    assert float(row["step_time_s"]) > 0 and float(row["tokens_per_s_per_device"]) > 0
    assert float(row["tflops_per_s_per_device"]) > 0 and float(row["mfu"]) > 0
    assert float(row["compile_s"]) > 0
    assert float(row["simulated_bubble"]) == pytest.approx(1 / 3)  # (p-1)/(m+p-1), p=m=2
    per_group = [int(b) for b in row["peak_live_bytes_per_group"].split(";")]
    assert len(per_group) == 2 and all(b > 0 for b in per_group)
    assert len(row["peak_activation_bytes_per_group"].split(";")) == 2
    assert "pipeline_schedule=1f1b" in row["config"]
    for name in ("sweep_step_time_bubble.png", "sweep_memory.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000, name
    summary = json.loads((out / "sweep.json").read_text())
    assert summary["ok"] == 1 and summary["machine"]["cpu_count"]
    assert (tmp_path / "runs" / Path(row["run_dir"]).name / "metrics.jsonl").exists()
