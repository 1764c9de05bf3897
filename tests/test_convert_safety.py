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
import os
import shutil
from pathlib import Path

import pytest
from fs_faults import tmpfs
from hf_reference import llama_config, random_tensors, write_hf_folder

from MaxText import generate
from MaxText.checkpoint import integrity
from MaxText.config import CONFIGS_DIR
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
        copy = tmp_path / f"c{len(list(tmp_path.iterdir()))}"
        shutil.copytree(model["ckpt"], copy)
        name = how(copy / "0")
        assert _generate_from(copy) == 2
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
