"""dataset_type=synthetic: learnable deterministic rows, exact resume, process slices."""

import json
import types

import numpy as np
import pytest

from MaxText.data import make_data
from MaxText.data.synthetic import FIRST, SYNTHETIC_EVAL_BATCHES


def make_config(**overrides):
    values = dict(dataset_type="synthetic", dataset_path="", dataset_name="", tokenizer_path="")
    values.update(
        vocab_size=50, max_target_length=64, global_batch_size=8, data_shuffle_seed=0, eval_steps=0
    )
    values.update(eval_split_fraction=0.05, base_output_directory="")
    values.update(train_split="train", eval_split="validation", packing=True)
    values.update(grain_train_files="", grain_eval_files="", grain_worker_count=0)
    values.update(overrides)
    return types.SimpleNamespace(**values)


def synthetic(**overrides):
    return make_data(make_config(**overrides))


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


def test_rows_are_learnable_progressions_with_full_masks():
    batch = next(synthetic().train)
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
        k: ((8, 64), np.dtype(np.int32)) for k in ("inputs", "targets", "targets_mask")
    }
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
    assert batch["targets_mask"].all()
    tokens = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1) - FIRST
    assert tokens.min() >= 0 and tokens.max() < 50 - FIRST
    stride = (tokens[:, 1] - tokens[:, 0]) % (50 - FIRST)
    np.testing.assert_array_equal(
        np.diff(tokens, axis=1) % (50 - FIRST), np.repeat(stride[:, None], 64, 1)
    )
    assert len(set(map(tuple, tokens[:, :2]))) > 1  # rows differ


def test_deterministic_under_seed_and_exact_resume():
    assert_batches_equal(take(synthetic().train, 3), take(synthetic().train, 3))
    assert not np.array_equal(
        next(synthetic(data_shuffle_seed=1).train)["inputs"], next(synthetic().train)["inputs"]
    )
    data = synthetic()
    take(data.train, 4)
    state = json.loads(json.dumps(data.train.get_state()))
    expected = take(data.train, 2)
    restored = synthetic()
    restored.train.set_state(state)
    assert_batches_equal(take(restored.train, 2), expected)
    with pytest.raises(ValueError, match=r"vocab_size: saved 50, now 60"):
        make_data(make_config(dataset_type="synthetic", vocab_size=60)).train.set_state(state)


def test_process_slices_make_the_global_batch():
    global_batch = next(synthetic().train)
    parts = [next(synthetic(process_index=p, process_count=4).train) for p in range(4)]
    for key in global_batch:
        np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), global_batch[key])


def test_eval_is_separate_finite_and_fresh():
    data = synthetic()
    evals = list(data.eval_batches())
    assert len(evals) == SYNTHETIC_EVAL_BATCHES
    assert_batches_equal(evals, list(data.eval_batches()))
    assert not np.array_equal(evals[0]["inputs"], next(synthetic().train)["inputs"])
    assert len(list(synthetic(eval_steps=2).eval_batches())) == 2


def test_id_tokenizer():
    tok = synthetic().tokenizer
    assert tok.encode("5 17 3") == [5, 17, 3] and tok.decode([5, 17, 3]) == "5 17 3"
    with pytest.raises(ValueError, match=r"text must be space-separated token ids"):
        tok.encode("hello")
    with pytest.raises(ValueError, match=r"outside \[0, vocab_size=50\)"):
        tok.encode("50")
