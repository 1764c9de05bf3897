"""Weights are precious (issue 36, items 1-5): the converters never overwrite a model, never leave
half a checkpoint, check everything before their first byte, and a damaged converted checkpoint
is one line.

One tiny Llama (1 layer, width 64, 96-id vocabulary) is written as a Hugging Face folder and
converted once (module fixture); each test copies what it damages. A full disk is a real one: a
tmpfs of 1 MB filled up to the last few KB (`tests/fs_faults.py`; skipped where the sandbox
cannot mount one). Nothing here compiles a training step.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from fs_faults import tmpfs
from hf_reference import llama_config, random_tensors, write_hf_folder

from MaxText import generate
from MaxText.checkpoint import integrity
from MaxText.config import CONFIGS_DIR
from MaxText.convert.output import check_hf_output, recorded_sources
from MaxText.errors import PathError
from MaxText.to_huggingface import main as to_huggingface
from MaxText.to_maxtext import main as to_maxtext

BASE = str(CONFIGS_DIR / "base.yml")


def _one_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    return err[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (relative path -> bytes): a listing and contents together."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def fill(folder: Path, leave_kb: int) -> None:
    """Fills the filesystem of `folder` up to its last `leave_kb` KB (`folder/filler`)."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    chunk = b"\0" * 4096
    try:
        while True:
            os.write(fd, chunk)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    size = (folder / "filler").stat().st_size
    os.truncate(folder / "filler", max(0, size - leave_kb * 1024))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> dict[str, Path]:
    """hf: a Hugging Face folder (no tokenizer); ckpt: its conversion (`ckpt/0/items`)."""
    base = tmp_path_factory.mktemp("convert_safety")
    cfg = llama_config(num_hidden_layers=1)
    hf = write_hf_folder(base / "hf", cfg, random_tensors(cfg, seed=0))
    ckpt = base / "ckpt"
    assert to_maxtext([BASE, f"hf_model_path={hf}", f"base_output_directory={ckpt}"]) == 0
    return {"hf": hf, "ckpt": ckpt, "base": base}


# ------------------------------------------------------- 2. checksums of converted checkpoints


def _generate_from(ckpt: Path) -> int:
    """generate's path to the parameters (it compiles only after reading them), on ids."""
    argv = [BASE, f"load_parameters_path={ckpt}", "dataset_type=synthetic", "prompt=5 6 7"]
    return generate.main(argv)


def test_a_converted_checkpoint_records_checksums_and_damage_is_one_line(model, tmp_path, capsys):
    step = model["ckpt"] / "0"
    assert integrity.verify_checksums(step)  # recorded, and they match
    recorded = set(snapshot(step)) - {integrity.CHECKSUMS, *integrity.UNCHECKED}
    assert len(recorded) > 10 and all(not name.endswith(".converting") for name in recorded)
    data = sorted(str(p.relative_to(step)) for p in (step / "items" / "d").iterdir())

    def damaged(how) -> tuple[Path, str]:
        """A damaged copy; generate (train's reader) and to_huggingface each refuse it in the
        same one line, the export writing nothing."""
        copy = tmp_path / f"c{len(list(tmp_path.iterdir()))}"
        shutil.copytree(model["ckpt"], copy)
        name = how(copy / "0")
        assert _generate_from(copy) == 2
        line = _one_line(capsys)
        out = tmp_path / "export"
        assert to_huggingface([BASE, f"load_parameters_path={copy}", f"hf_output_path={out}"]) == 2
        assert _one_line(capsys) == line and not out.exists()
        print(line, file=sys.stderr)  # for the caller's check
        return copy / "0", name

    def truncate(step_dir):
        os.truncate(step_dir / data[0], 10)
        return data[0]

    def random_bytes(step_dir):  # same size: only the checksum tells
        path = step_dir / data[-1]
        path.write_bytes(os.urandom(path.stat().st_size))
        return data[-1]

    def metadata(step_dir):
        (step_dir / "items" / "_METADATA").write_bytes(os.urandom(64))
        return "items/_METADATA"

    advice = f"convert it again into a new folder (python -m MaxText.to_maxtext ... hf_model_path={model['hf']})"  # noqa: E501
    for how, what in (
        (truncate, "has 10 bytes, {} when written (checksums.json)"),
        (random_bytes, "does not match its checksum (crc32 "),
        (metadata, "has 64 bytes, {} when written (checksums.json)"),
    ):
        step_dir, name = damaged(how)
        line = _one_line(capsys)
        size = (step / name).stat().st_size
        assert line.startswith(
            f"checkpoint error: checkpoint {step_dir} is damaged: {name} " + what.format(size)
        ), line
        assert line.endswith(advice), line
    # a conversion made before checksums were recorded: every stored chunk is read instead
    step_dir, _ = damaged(lambda s: (s / integrity.CHECKSUMS).unlink() or truncate(s))
    assert _one_line(capsys).startswith(
        f"checkpoint error: checkpoint {step_dir} is damaged: ValueError: OUT_OF_RANGE: "
    )


def test_to_huggingface_checks_a_runs_checkpoint_against_its_checksums(model, tmp_path, capsys):
    """A step of a run (its `state` item; here the converted arrays under that name, with the
    checksums recorded as a training save does), one data file truncated."""
    step = tmp_path / "run" / "checkpoints" / "3"
    shutil.copytree(model["ckpt"] / "0", step)
    (step / "items").rename(step / "state")
    (step / integrity.CHECKSUMS).unlink()
    integrity.record_checksums(step)
    name = sorted(str(p.relative_to(step)) for p in (step / "state" / "d").iterdir())[0]
    os.truncate(step / name, 10)
    out = tmp_path / "export"
    assert to_huggingface([BASE, f"load_parameters_path={step}", f"hf_output_path={out}"]) == 2
    assert _one_line(capsys) == (
        f"checkpoint error: checkpoint {step} is damaged: {name} has 10 bytes, "
        f"{(model['ckpt'] / '0' / name.replace('state', 'items', 1)).stat().st_size} when written "
        f"(checksums.json); export another step of the run (load_parameters_path="
        f"{step.parent}/<step>)"
    )
    assert not out.exists()


# ---------------------------------------------------------------- 3. a full disk during a write


def test_a_full_disk_during_to_maxtext_is_one_line_and_leaves_nothing(model, tmp_path, capsys):
    with tmpfs(tmp_path / "disk", 1) as disk:
        fill(disk, leave_kb=64)  # the checkpoint needs ~150 KB
        out = disk / "new" / "ckpt"  # two folders to make: both taken back
        argv = [BASE, f"hf_model_path={model['hf']}", f"base_output_directory={out}"]
        assert to_maxtext(argv) == 1
        line = _one_line(capsys)
        assert line.startswith(
            f"I/O error: writing {out / '0'} failed: No space left on device (ENOSPC) at "
            f"{out / '0.converting'}/"
        ), line
        assert line.endswith(
            "; the partial output was removed; free space (or fix the permissions) and convert "
            "again"
        ), line
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]  # nothing else on the disk
        (disk / "filler").unlink()  # space freed: the same command now converts
        assert to_maxtext(argv) == 0
        assert len(snapshot(out / "0")) == len(snapshot(model["ckpt"] / "0"))
        assert integrity.verify_checksums(out / "0")


def test_a_full_disk_during_to_huggingface_is_one_line_and_keeps_the_old_export(
    model, tmp_path, capsys
):
    with tmpfs(tmp_path / "disk", 1) as disk:
        old = disk / "export"
        argv = [BASE, f"load_parameters_path={model['ckpt']}"]
        assert to_huggingface([*argv, f"hf_output_path={old}"]) == 0
        capsys.readouterr()
        before = snapshot(old)
        fill(disk, leave_kb=64)  # the export writes ~150 KB
        for out, extra in ((old, ["hf_overwrite=true"]), (disk / "new" / "export", [])):
            assert to_huggingface([*argv, f"hf_output_path={out}", *extra]) == 1
            line = _one_line(capsys)
            assert line.startswith(
                f"I/O error: writing {out} failed: No space left on device (ENOSPC) at "
                f"{out / '.exporting' / 'model.safetensors.tmp'}; the partial output was removed"
            ), line
        assert snapshot(old) == before  # the earlier export is untouched
        assert sorted(p.name for p in disk.iterdir()) == ["export", "filler"]


# -------------------------------------------------------- 1. never over a model, never the source


def test_to_huggingface_never_overwrites_a_model(model, tmp_path, capsys):
    argv = [BASE, f"load_parameters_path={model['ckpt']}"]
    out = tmp_path / "export"
    assert to_huggingface([*argv, f"hf_output_path={out}", "hf_max_shard_mb=0.05"]) == 0
    capsys.readouterr()
    (out / "README.md").write_text("the user's notes\n")
    first = snapshot(out)
    assert "model.safetensors.index.json" in first and len(first) == 10  # 6 shards
    assert to_huggingface([*argv, f"hf_output_path={out}"]) == 2
    assert _one_line(capsys) == (
        f"path error: hf_output_path={out} already holds a model (config.json, "
        f"generation_config.json, model-00001-of-00006.safetensors, "
        f"model-00002-of-00006.safetensors and 5 more); export into a new or empty folder, or set "
        f"hf_overwrite=true to replace it"
    )
    assert snapshot(out) == first
    # any one file of a model is a model
    for name in ("config.json", "pytorch_model-00001-of-00002.bin", "tokenizer.json"):
        other = tmp_path / name.split(".")[0]
        other.mkdir()
        (other / name).write_text("{}")
        assert to_huggingface([*argv, f"hf_output_path={other}"]) == 2
        assert f"already holds a model ({name})" in _one_line(capsys)
        assert [p.name for p in other.iterdir()] == [name]
    # hf_overwrite=true replaces it: the old shards and index go, the user's README stays
    assert to_huggingface([*argv, f"hf_output_path={out}", "hf_overwrite=true"]) == 0
    assert sorted(snapshot(out)) == [
        "README.md",
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert (out / "README.md").read_text() == "the user's notes\n"


def test_to_huggingface_into_the_source_folder_is_refused_and_leaves_it_unchanged(
    model, tmp_path, capsys
):
    """The issue's case: a bfloat16 export over the float32 folder the checkpoint came from,
    even with hf_overwrite=true, through a symbolic link to it, and from a run that started from
    the converted checkpoint."""
    hf = model["hf"]
    before = snapshot(hf)
    link = tmp_path / "link"
    link.symlink_to(hf)
    for target in (hf, link):
        argv = [BASE, f"load_parameters_path={model['ckpt']}", f"hf_output_path={target}"]
        assert to_huggingface([*argv, "hf_overwrite=true", "hf_output_dtype=bfloat16"]) == 2
        assert _one_line(capsys) == (
            f"path error: hf_output_path={target} is the folder the checkpoint was converted "
            f"from; export into another folder (hf_overwrite=true never replaces a checkpoint's "
            f"source)"
        )
    assert snapshot(hf) == before  # byte for byte
    # a run that started from the converted checkpoint has the same source (its saved config)
    run = tmp_path / "runs" / "ft"
    (run / "checkpoints" / "7" / "config").mkdir(parents=True)
    saved = {"load_parameters_path": str(model["ckpt"])}
    (run / "checkpoints" / "7" / "config" / "metadata").write_text(json.dumps(saved))
    assert recorded_sources(str(run)) == [hf]
    with pytest.raises(PathError, match="is the folder the checkpoint was converted from"):
        check_hf_output(hf, overwrite=True, sources=recorded_sources(str(run)))
    check_hf_output(tmp_path / "elsewhere", overwrite=False, sources=[hf])  # not refused
    assert not (tmp_path / "elsewhere").exists()  # checked, not made


# ----------------------------------------------------- 4. NaN / Inf weights, refused as they stream


def test_non_finite_weights_are_refused_naming_the_tensor(model, tmp_path, capsys):
    cfg = llama_config(num_hidden_layers=1)
    tensors = random_tensors(cfg, seed=0)
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name][0, :3] = [np.nan, np.nan, np.inf]
    bad = write_hf_folder(tmp_path / "bad", cfg, tensors)
    out = tmp_path / "out"
    assert to_maxtext([BASE, f"hf_model_path={bad}", f"base_output_directory={out}"]) == 2
    assert _one_line(capsys) == (
        f"config error: hf_model_path={bad}: tensor {name} has 2 NaN and 1 infinite values (of "
        f"{tensors[name].size}); the checkpoint is damaged or comes from a diverged run, so "
        f"nothing was written"
    )
    assert not out.exists()
    # export: a finite checkpoint whose cast to float16 overflows (65504 is float16's largest)
    tensors = random_tensors(cfg, seed=0)
    tensors["model.norm.weight"][5] = 1e5
    big = write_hf_folder(tmp_path / "big", cfg, tensors)
    ckpt = tmp_path / "big_ckpt"
    assert to_maxtext([BASE, f"hf_model_path={big}", f"base_output_directory={ckpt}"]) == 0
    capsys.readouterr()
    argv = [BASE, f"load_parameters_path={ckpt}", f"hf_output_path={out}"]
    assert to_huggingface([*argv, "hf_output_dtype=float16"]) == 2
    assert _one_line(capsys) == (
        f"config error: checkpoint {ckpt / '0' / 'items'}: tensor model.norm.weight overflows "
        f"float16 (1 values become infinite; the largest is 1e+05); choose a wider dtype "
        f"(bfloat16 or float32)"
    )
    assert not out.exists()


# ---------------------------------------------------------- 5. every check before the first byte


def test_refusals_come_before_the_output_folder_is_made(model, tmp_path, capsys):
    out = tmp_path / "out"
    export = [BASE, f"load_parameters_path={model['ckpt']}", f"hf_output_path={out}"]
    missing = tmp_path / "tokenizer.json"
    assert to_huggingface([*export, f"tokenizer_path={missing}"]) == 2
    assert _one_line(capsys).startswith(f"config error: tokenizer_path={missing} does not exist")
    assert to_huggingface([*export, "hf_output_dtype=float64"]) == 2
    assert _one_line(capsys).startswith("config error: hf_output_dtype=float64 is not one of")
    cfg = llama_config(num_hidden_layers=1)
    tensors = random_tensors(cfg, seed=0)
    del tensors["model.norm.weight"]
    partial = write_hf_folder(tmp_path / "partial", cfg, tensors)
    assert to_maxtext([BASE, f"hf_model_path={partial}", f"base_output_directory={out}"]) == 2
    assert _one_line(capsys) == (
        f"config error: hf_model_path={partial}: tensor model.norm.weight is missing"
    )
    assert not out.exists()
    # what a killed conversion or export left behind is named, not reused or removed
    (out / "0.converting").mkdir(parents=True)
    convert = [BASE, f"hf_model_path={model['hf']}", f"base_output_directory={out}"]
    assert to_maxtext(convert) == 2
    assert _one_line(capsys) == (
        f"path error: base_output_directory={out}: {out / '0.converting'} is left from a "
        f"conversion that was stopped (or is running); remove it, or choose another "
        f"base_output_directory"
    )
    (out / ".exporting").mkdir()
    assert to_huggingface(export) == 2
    assert _one_line(capsys) == (
        f"path error: hf_output_path={out} holds {out / '.exporting'}, left by an export that "
        f"was stopped (or is running); remove it and export again"
    )
    assert sorted(p.name for p in out.iterdir()) == [".exporting", "0.converting"]
