"""dataset_type=grain: prepare, packing with masks, per-process rows, exact resume, eval.

The corpus is made here: 120 documents of random words (a .jsonl, a .txt and a .md file), so
lengths vary from a few tokens to several rows of 16 and the expected rows can be computed by hand
from the shards' records.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
import types

import numpy as np
import pytest
from compare import assert_bitwise, reordered_sum_rtol

from MaxText.data import doc_packing, make_data
from MaxText.data import grain_pipeline as gp
from MaxText.data import prepare as prepare_lib
from MaxText.data.errors import DataError
from MaxText.data.tokenizer import load_sentencepiece

WORDS = "thou art the fairest rose in all of verona and yet my lord doth speak".split()
L = 16


def write_corpus(root, num_docs: int, seed: int = 0):
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    texts = [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) for _ in range(num_docs)
    ]
    with (root / "docs.jsonl").open("w") as f:
        for t in texts[:-2]:
            f.write(json.dumps({"text": t, "id": 1}) + "\n")
    (root / "one.txt").write_text(texts[-2])
    (root / "two.md").write_text("# Title\n\n" + texts[-1])
    return texts


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    base = tmp_path_factory.mktemp("grain")
    texts = write_corpus(base / "corpus", 120)
    manifest = prepare_lib.prepare(
        str(base / "corpus"),
        str(base / "shards"),
        vocab_size=320,
        shard_size=50,
        eval_fraction=0.1,
        quiet=True,
    )
    return base / "shards", manifest, texts


def config(shards, **overrides):
    values = dict(
        dataset_type="grain",
        dataset_path="",
        dataset_name="",
        train_split="train",
        eval_split="validation",
        tokenizer_path="",
        vocab_size=512,
        max_target_length=L,
        global_batch_size=4,
        data_shuffle_seed=0,
        eval_steps=0,
        eval_split_fraction=0.05,
        base_output_directory="",
        packing=True,
        grain_train_files=str(shards / "train-*.array_record"),
        grain_eval_files=str(shards / "eval-*.array_record"),
        grain_worker_count=0,
    )
    values.update(overrides)
    return types.SimpleNamespace(**values)


def records(shards, split):
    from array_record.python.array_record_module import ArrayRecordReader

    out = []
    for path in sorted(shards.glob(f"{split}-*.array_record")):
        reader = ArrayRecordReader(str(path))
        out += [np.frombuffer(r, "<u2").astype(np.int32) for r in reader.read_all()]
        reader.close()
    return out


def take(it, n):
    return [next(it) for _ in range(n)]


# ------------------------------------------------------------------------------------- prepare


def test_prepare_writes_every_document_tokenized_in_shards(prepared):
    shards, manifest, texts = prepared
    tok = load_sentencepiece(str(shards / "tokenizer.model"))
    train, held = records(shards, "train"), records(shards, "eval")
    assert len(train) + len(held) == len(texts) == 120
    assert manifest["splits"]["train"]["documents"] == len(train)
    assert manifest["splits"]["train"]["tokens"] == sum(r.size for r in train)
    assert [s["documents"] for s in manifest["splits"]["train"]["shards"]][0] == 50
    assert 0 < len(held) < 30  # ~10 % held out by name hash
    assert manifest["dtype"] == "uint16" and manifest["vocab_size"] == tok.vocab_size
    decoded = sorted(tok.decode(r) for r in train + held)
    assert decoded == sorted([*texts[:-1], "Title\n\n" + texts[-1]])  # markdown stripped
    for r in train:
        assert r[0] == tok.bos_id and r[-1] == tok.eos_id


def test_add_bos_and_add_eos_are_written_and_must_agree_with_the_config(prepared, tmp_path):
    """MaxText's add_bos/add_eos: `prepare --add_bos false` writes documents without BOS (EOS
    kept) and records it; a training config that disagrees is refused in one data-error line
    naming the key and both fixes, before any batch is read; the config that agrees trains."""
    shards, manifest, texts = prepared
    assert (manifest["add_bos"], manifest["add_eos"]) == (True, True)
    out = tmp_path / "no_bos"
    argv = ["--input", str(shards.parent / "corpus"), "--out", str(out), "--quiet"]
    argv += ["--tokenizer_path", str(shards / "tokenizer.model"), "--add_bos", "false"]
    assert prepare_lib.main(argv) == 0
    tok = load_sentencepiece(str(out / "tokenizer.model"))
    written = json.loads((out / "manifest.json").read_text())
    assert (written["add_bos"], written["add_eos"]) == (False, True)
    train = records(out, "train")
    assert len(train) == len(texts)
    for r in train:
        assert r[0] != tok.bos_id and r[-1] == tok.eos_id
    assert sorted(r.tolist() for r in train) == sorted(
        r[1:].tolist() for r in records(shards, "train") + records(shards, "eval")
    )
    pattern = str(out / "train-*.array_record")
    with pytest.raises(DataError) as refused:
        make_data(config(out, grain_eval_files="", add_bos=True, add_eos=True))
    assert str(refused.value) == (
        f"grain_train_files={pattern!r} was prepared with add_bos=false but the config has "
        "add_bos=true; set add_bos=false, or prepare the data again with --add_bos true"
    )
    batch = next(make_data(config(out, grain_eval_files="", add_bos=False, add_eos=True)).train)
    assert batch["inputs"].shape == (4, L)


def test_prepare_errors_are_one_line(tmp_path, prepared, capsys):
    shards, _, _ = prepared
    assert prepare_lib.main(["--input", str(tmp_path / "none"), "--out", str(tmp_path)]) == 2
    assert "matches no .txt, .md or .jsonl file" in capsys.readouterr().err
    assert prepare_lib.main(["--input", str(tmp_path), "--out", str(shards), "--quiet"]) == 2


def _damage(shards, tmp_path, how: str):
    """A copy of the prepared folder whose first train shard is truncated, replaced by random
    bytes of the same size, or altered in one chunk (64 bytes of 0xFF, same size)."""
    copy = tmp_path / how
    shutil.copytree(shards, copy)
    target = copy / "train-00000.array_record"
    size = target.stat().st_size
    if how == "truncated":
        os.truncate(target, size // 2)
    elif how == "random":
        target.write_bytes(np.random.default_rng(0).bytes(size))
    else:
        with open(target, "r+b") as f:
            f.seek(3000)
            f.write(b"\xff" * 64)
    return copy, target


@pytest.mark.parametrize("how", ["truncated", "random"])
def test_a_damaged_shard_is_a_data_error_before_compiling(prepared, tmp_path, capsys, how):
    """Found when the shards are opened (their record counts against the manifest's), so the
    trainer exits 2 with one line naming the file before it compiles anything."""
    from MaxText.config import CONFIGS_DIR
    from MaxText.train import main

    copy, target = _damage(prepared[0], tmp_path, how)
    with pytest.raises(DataError, match=f"^{target}: .*the shard is damaged or not an ArrayRecord"):
        make_data(config(copy))
    argv = [
        str(CONFIGS_DIR / "base.yml"),
        "vocab_size=512",
        "dataset_type=grain",
        f"grain_train_files={copy}/train-*.array_record",
        f"grain_eval_files={copy}/eval-*.array_record",
        f"base_output_directory={tmp_path}",
    ]
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"data error: {target}: "), err


@pytest.mark.parametrize("workers", [0, 2])
def test_a_damaged_chunk_is_a_data_error_naming_the_shard(prepared, tmp_path, workers):
    """Bytes altered inside a chunk (same size) fail ArrayRecord's chunk hash when read, in the
    trainer's process or in a grain worker; the error names the shard and the record."""
    copy, target = _damage(prepared[0], tmp_path, "chunk")
    data = make_data(config(copy, grain_worker_count=workers))
    try:
        with pytest.raises(DataError) as failed:
            take(iter(data.train), 100)
    finally:
        data.close()
    assert str(failed.value).startswith(f"{target}: record ")
    assert "is unreadable (Corrupted Riegeli/records file: " in str(failed.value)


# ------------------------------------------------------------------------------------- packing


def test_pack_rows_by_hand():
    a = np.array([2, 10, 11, 12, 3])  # 4 pairs
    b = np.array([2, 20, 21, 3])  # 3 pairs
    c = np.arange(100, 111)  # 10 pairs -> segments of 6 and 4 with L=6
    rows = doc_packing.pack_rows([a, b, c], 6)
    # first fit: a (4) -> row 0; b (3) -> row 1; c[0:7] (6) -> row 2; c[6:11] (4) -> row 1? no
    # (room 3) -> row 3... b fits row 1 (room 6 -> 3); c's second segment (4) -> new row 3.
    np.testing.assert_array_equal(rows["inputs"][0], [2, 10, 11, 12, 0, 0])
    np.testing.assert_array_equal(rows["targets"][0], [10, 11, 12, 3, 0, 0])
    np.testing.assert_array_equal(rows["inputs_segmentation"][0], [1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(rows["inputs"][1], [2, 20, 21, 0, 0, 0])
    np.testing.assert_array_equal(rows["inputs"][2], c[0:6])
    np.testing.assert_array_equal(rows["targets"][2], c[1:7])
    np.testing.assert_array_equal(rows["inputs"][3], [106, 107, 108, 109, 0, 0])
    np.testing.assert_array_equal(rows["targets"][3], [107, 108, 109, 110, 0, 0])
    np.testing.assert_array_equal(rows["targets_mask"][3], [1, 1, 1, 1, 0, 0])
    small = doc_packing.pack_rows([np.array([2, 5, 3]), np.array([2, 6, 7, 3])], 6)
    np.testing.assert_array_equal(small["inputs"], [[2, 5, 2, 6, 7, 0]])
    np.testing.assert_array_equal(small["inputs_segmentation"], [[1, 1, 2, 2, 2, 0]])
    np.testing.assert_array_equal(small["inputs_position"], [[0, 1, 0, 1, 2, 0]])
    unpacked = doc_packing.pack_rows([np.array([2, 5, 3]), c], 6, packing=False)
    np.testing.assert_array_equal(unpacked["inputs"], [[2, 5, 0, 0, 0, 0], c[:6]])  # truncated


def test_every_target_is_predicted_once_per_epoch(prepared):
    """Over one epoch (documents_per_window covers all), the counted targets are exactly the
    documents' tokens after their first: nothing lost, nothing twice."""
    shards, _, _ = prepared
    docs = records(shards, "train")
    rows = doc_packing.pack_rows(docs, L)
    got = np.sort(rows["targets"][rows["targets_mask"] == 1])
    want = np.sort(np.concatenate([d[1:] for d in docs]))
    np.testing.assert_array_equal(got, want)
    fill = rows["targets_mask"].mean()
    assert fill > 0.9, fill  # first fit packs the rows


# ------------------------------------------------------------------------ iterator and resume


def test_batches_are_packed_rows_and_resume_is_exact_with_other_worker_count(prepared):
    shards, _, _ = prepared
    data = make_data(config(shards))
    first = take(data.train, 7)
    for key in doc_packing.ROW_KEYS:
        assert first[0][key].shape == (4, L) and first[0][key].dtype == np.int32
    assert max(b["inputs_segmentation"].max() for b in first) >= 2  # several docs in a row
    state = json.loads(json.dumps(data.train.get_state()))
    expected = take(data.train, 6)
    # a worker process (its windows in grain's shared memory) from a restored position
    again = make_data(config(shards, grain_worker_count=1))
    again.train.set_state(state)
    got = take(again.train, 6)
    again.train.close()
    assert_bitwise(expected, got, "batches after resume")


def test_close_unlinks_the_shared_memory_of_every_batch_read(prepared, monkeypatch):
    """A worker hands each batch over in shared memory, which grain unlinks on a background
    thread once the batch is read; `close()` waits for that thread, so a process exiting right
    after (a second Ctrl-C ends in `os._exit`) leaves nothing behind for multiprocessing's
    resource tracker to unlink and warn about. That thread is slowed down here (0.3 s per
    segment), as on a loaded machine: every segment it was handed is gone when `close()`
    returns. (Segments are named as the thread receives them, not by listing /dev/shm: another
    xdist worker's trainers create their own there meanwhile.)"""
    from grain._src.python.ipc.shared_memory_array import SharedMemoryArray

    unlink = SharedMemoryArray.close_shm_async
    handed: list[str] = []

    def slow(shm, unlink_it):
        handed.append(shm.name)
        time.sleep(0.3)
        unlink(shm, unlink_it)

    monkeypatch.setattr(SharedMemoryArray, "close_shm_async", slow)
    data = make_data(config(prepared[0], grain_worker_count=1))
    take(data.train, 3)
    data.train.close()
    assert handed  # the batches did come through shared memory and that thread
    assert [n for n in handed if os.path.exists(f"/dev/shm/{n.lstrip('/')}")] == []


def test_shuffle_seed_and_state_fingerprint(prepared):
    shards, _, _ = prepared
    a = next(make_data(config(shards)).train)
    b = next(make_data(config(shards, data_shuffle_seed=1)).train)
    assert not np.array_equal(a["inputs"], b["inputs"])
    state = make_data(config(shards)).train.get_state()
    other = make_data(config(shards, max_target_length=8))
    with pytest.raises(ValueError, match=r"max_target_length: saved 16, now 8"):
        other.train.set_state(state)


@pytest.mark.parametrize(
    "override, named",
    [
        ({"process_count": 2}, "process_count: saved 1, now 2"),
        ({"grain_train_files": "train-00000.array_record"}, "files: saved"),
        ({"packing": False}, "packing: saved True, now False"),
        ({"data_shuffle_seed": 1}, "seed: saved 0, now 1"),
    ],
    ids=["process_count", "shards", "packing", "seed"],
)
def test_state_refused_with_other_data(prepared, override, named):
    """A saved position is refused, naming the key, when the process count, the shard set,
    packing or the shuffle seed differ (max_target_length: the test above)."""
    shards, _, _ = prepared
    state = make_data(config(shards)).train.get_state()
    if "grain_train_files" in override:
        override = {"grain_train_files": str(shards / override["grain_train_files"])}
        # a strict subset of the saved shard set (how many shards there are depends on the split)
        assert len(list(shards.glob("train-*"))) > len(list(shards.glob("train-00000.*"))) == 1
    other = make_data(config(shards, **override))
    with pytest.raises(ValueError, match=re.escape(named)):
        other.train.set_state(state)


def test_each_process_reads_only_its_documents(prepared):
    """Process p of P reads documents p, p+P, ... of the shards: over an epoch (packing off,
    one document per row, windows of one document) its rows are exactly those documents."""
    shards, _, _ = prepared
    docs = records(shards, "train")
    P = 3
    seen = []
    for p in range(P):
        windows = gp.train_windows(
            gp.TokenShards(str(shards / "train-*.array_record"), "grain_train_files"),
            packer=gp.Packer(seq_len=256, packing=False, pad_id=0),
            seed=5,
            process_index=p,
            process_count=P,
            documents_per_window=1,
        )
        mine = docs[p::P]
        rows = [windows[i]["inputs"][0] for i in range(len(mine))]
        got = sorted(tuple(r[r != 0]) for r in rows)
        assert got == sorted(tuple(d[:-1]) for d in mine)
        seen += got
    assert sorted(seen) == sorted(tuple(d[:-1]) for d in docs)


def test_eval_covers_the_held_out_documents_once_on_every_process(prepared):
    shards, _, _ = prepared
    held = records(shards, "eval")
    want = np.sort(np.concatenate([d[1:] for d in held]))
    per_process = [
        list(make_data(config(shards, process_index=p, process_count=2)).eval_batches())
        for p in range(2)
    ]
    assert len(per_process[0]) == len(per_process[1]) > 0
    targets = [b["targets"][b["targets_mask"] == 1] for batches in per_process for b in batches]
    np.testing.assert_array_equal(np.sort(np.concatenate(targets)), want)
    assert all(b["inputs"].shape == (2, L) for b in per_process[0])


# ------------------------------------------------------------------- packed loss (model side)


@pytest.mark.parametrize("block", ["llama", "gpt"])
def test_packed_batch_loss_is_the_sum_of_each_documents_loss(block):
    """The train step's loss function on packed rows (segment ids, restarting positions,
    padding masked) equals the documents' losses computed one by one, unpacked, within the bound
    for a sum of the counted tokens' positive losses added in another order (not bitwise: the
    packed row's reductions run over other lengths; `reordered_sum_rtol`, tests/compare.py); the
    counted tokens are equal exactly."""
    import jax
    import jax.numpy as jnp

    from MaxText.config import CONFIGS_DIR, load_config
    from MaxText.model import Decoder
    from MaxText.train_step import (
        CPU_INIT_COMPILER_OPTIONS,
        PACKED_BATCH_KEYS,
        batch_keys,
        make_loss_fn,
    )

    small = [
        str(CONFIGS_DIR / "base.yml"),
        "emb_dim=32",
        "num_query_heads=4",
        "num_kv_heads=2",
        "head_dim=8",
        "mlp_dim=64",
        "num_decoder_layers=2",
        "vocab_size=64",
        f"max_target_length={L}",
        f"decoder_block={block}",
    ]
    packed_cfg = load_config(
        [*small, "dataset_type=grain", "grain_train_files=x", "eval_interval=0"]
    )
    plain_cfg = load_config([*small, "dataset_type=synthetic"])
    assert (
        batch_keys(packed_cfg) == PACKED_BATCH_KEYS and batch_keys(plain_cfg) != PACKED_BATCH_KEYS
    )
    rng = np.random.default_rng(0)
    docs = [rng.integers(4, 64, n) for n in (5, 9, 3, 14, 7, 30)]  # the 30 spans two rows
    rows = doc_packing.pack_rows(docs, L)
    assert rows["inputs"].shape[0] < len(docs) + 1 and rows["inputs_segmentation"].max() >= 2
    # the trainer's init options on CPU (level 0: XLA:CPU spends most of an init's compile on
    # optimising the random number generator); the test's point is the loss, not the init
    init_args = (jax.random.key(0), jnp.zeros((1, L), jnp.int32))
    init = jax.jit(Decoder(packed_cfg).init).lower(*init_args)
    params = init.compile(compiler_options=CPU_INIT_COMPILER_OPTIONS)(*init_args)["params"]
    packed_loss = jax.jit(make_loss_fn(Decoder(packed_cfg)))
    plain_loss = jax.jit(make_loss_fn(Decoder(plain_cfg)))
    got_sum, got_count = packed_loss(params, {k: jnp.asarray(v) for k, v in rows.items()})
    # Reference: every document (a long one: each of its L-token pieces) alone in its own row,
    # plain causal attention from position 0; what follows it in the row is masked padding,
    # which a causal model cannot see.
    spans = [span for doc in docs for span in doc_packing.segments_of(doc, L, packing=True)]
    alone = np.zeros((len(spans), L + 1), np.int32)
    mask = np.zeros((len(spans), L), np.float32)
    for i, span in enumerate(spans):
        alone[i, : span.size] = span
        mask[i, : span.size - 1] = 1
    one_by_one = [
        plain_loss(
            params,
            {
                "inputs": alone[i : i + 1, :-1],
                "targets": alone[i : i + 1, 1:],
                "targets_mask": mask[i : i + 1],
            },
        )
        for i in range(len(spans))
    ]
    want_sum = sum(float(s) for s, _ in one_by_one)
    want_count = sum(float(c) for _, c in one_by_one)
    assert float(got_count) == want_count == sum(d.size - 1 for d in docs)
    rtol = reordered_sum_rtol(int(want_count), squared=False)
    np.testing.assert_allclose(float(got_sum), want_sum, rtol=rtol)
