"""dataset_type=tfds: a tiny TFDS builder over local text, prepared as array_record, no network."""

import json
import types

import numpy as np
import pytest

tfds = pytest.importorskip("tensorflow_datasets", reason="tensorflow-datasets is not installed")

from MaxText.data import make_data  # noqa: E402

LINES = [
    "Shall I compare thee to a summer's day?",
    "Thou art more lovely and more temperate:",
    "Rough winds do shake the darling buds of May,",
    "And summer's lease hath all too short a date;",
]


class TinySonnets(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Train/validation splits of numbered sonnet lines, built from local strings."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()})
        )

    def _split_generators(self, dl_manager):
        return {
            "train": self._generate_examples(60, "Train"),
            "validation": self._generate_examples(6, "Held"),
        }

    def _generate_examples(self, n, split):
        for i in range(n):
            yield i, {"text": f"{split} {i}. " + " ".join(LINES[(i + j) % 4] for j in range(3))}


class TwoTexts(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Only a train split, with two text features."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        features = {"title": tfds.features.Text(), "body": tfds.features.Text()}
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(features))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples()}

    def _generate_examples(self):
        for i in range(40):
            yield i, {"title": f"Sonnet {i}", "body": " ".join(LINES) + f" ({i})"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tfds")
    for builder_cls in (TinySonnets, TwoTexts):
        builder_cls(data_dir=str(root), file_format="array_record").download_and_prepare()
    return str(root)


def make_config(**overrides):
    values = dict(dataset_type="tfds", dataset_path="", dataset_name="", tokenizer_path="")
    values.update(
        vocab_size=400,
        max_target_length=32,
        global_batch_size=4,
        data_shuffle_seed=0,
        eval_steps=0,
        train_split="train",
        eval_split="validation",
    )
    values.update(eval_split_fraction=0.1, base_output_directory="", packing=True)
    values.update(grain_train_files="", grain_eval_files="", grain_worker_count=0)
    values.update(overrides)
    return types.SimpleNamespace(**values)


def test_tfds_dataset_trains_tokenizer_and_packs_batches(data_dir, tmp_path):
    cfg = make_config(
        dataset_path=data_dir, dataset_name="tiny_sonnets", base_output_directory=str(tmp_path)
    )
    data = make_data(cfg)
    assert "eval = validation" in data.info.description
    batch = next(data.train)
    for value in batch.values():
        assert value.shape == (4, 32) and value.dtype == np.int32
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
    assert data.tokenizer.decode(data.tokenizer.encode(LINES[0])) == LINES[0]
    assert data.tokenizer.origin == "trained"
    # Eval is the validation split ("Held ..."), never seen in training.
    eval_text = data.tokenizer.decode(
        np.concatenate([b["inputs"].reshape(-1) for b in data.eval_batches()])
    )
    assert eval_text.count("Held") == 6 and "Held 5." in eval_text and "Train" not in eval_text
    n = data.info.num_train_examples
    epoch = np.concatenate([next(data.train)["inputs"] for _ in range(-(-n // 4))])[:n]
    rows = [data.tokenizer.decode(row) for row in epoch]
    assert not any("Held" in row for row in rows)
    assert sum(row.count("Train") for row in rows) >= 55  # a few are cut at window edges
    # Exact resume, and the second load uses the caches.
    state = json.loads(json.dumps(data.train.get_state()))
    expected = next(data.train)
    again = make_data(cfg)
    assert again.tokenizer.origin == "cache"
    again.train.set_state(state)
    got = next(again.train)
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key])


def test_text_feature_detection_and_choice(data_dir, tmp_path):
    cfg = make_config(
        dataset_path=data_dir, dataset_name="two_texts", base_output_directory=str(tmp_path)
    )
    with pytest.raises(ValueError, match=r"has text features \['body', 'title'\]; name the one"):
        make_data(cfg)
    data = make_data(cfg, tfds_text_feature="body")
    assert "eval = last 0.1 of train" in data.info.description
    assert data.info.num_eval_tokens > 0
    text = data.tokenizer.decode(next(data.eval_batches())["inputs"][0])
    assert "Sonnet" not in text and "summer" in text
    with pytest.raises(ValueError, match=r"has no text feature 'poem'"):
        make_data(cfg, tfds_text_feature="poem")


def test_missing_dataset_is_a_clear_error_and_nothing_downloads(data_dir, tmp_path):
    base = str(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no prepared TFDS dataset 'no_such_set'"):
        make_data(
            make_config(
                dataset_path=data_dir, dataset_name="no_such_set", base_output_directory=base
            )
        )
    # A registered TFDS dataset that is not prepared here is not downloaded.
    with pytest.raises(FileNotFoundError, match=r"'tiny_shakespeare' is not prepared"):
        make_data(
            make_config(
                dataset_path=data_dir, dataset_name="tiny_shakespeare", base_output_directory=base
            )
        )
    with pytest.raises(ValueError, match=r"needs dataset_name="):
        make_data(make_config(dataset_path=data_dir, base_output_directory=base))


def test_train_split_and_eval_split_choose_the_splits(data_dir, tmp_path):
    """MaxText's train_split / eval_split (issue #11 item 6: the dead dataset_split is gone)."""
    cfg = make_config(
        dataset_path=data_dir,
        dataset_name="tiny_sonnets",
        base_output_directory=str(tmp_path),
        train_split="validation",
        eval_split="train",
    )
    data = make_data(cfg)
    assert "eval = train" in data.info.description
    train_text = data.tokenizer.decode(next(data.train)["inputs"].reshape(-1))
    assert "Held" in train_text and "Train" not in train_text
    eval_text = data.tokenizer.decode(next(data.eval_batches())["inputs"].reshape(-1))
    assert "Train" in eval_text and "Held" not in eval_text
    with pytest.raises(FileNotFoundError, match=r"has no split train_split='dev'"):
        make_data(
            make_config(dataset_path=data_dir, dataset_name="tiny_sonnets", train_split="dev")
        )
