"""Data settings that cannot work end the run with exit code 2 and one line (issue #11, item 5).

Each case runs the trainer's entry point `MaxText.train.main` in-process and checks the return
code and that stderr holds exactly one line naming the setting (no traceback).
"""

import re

import numpy as np
import pytest

from MaxText.config import CONFIGS_DIR, ConfigError, load_config
from MaxText.data import make_data
from MaxText.train import main


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["tokenizer_path=/nonexistent.model"], "tokenizer_path='/nonexistent.model' is not"),
        (["dataset_path=/nonexistent"], "dataset_path='/nonexistent' is neither"),
        (["dataset_type=tfds", "dataset_name=foo"], "no prepared TFDS dataset 'foo'"),
    ],
)
def test_data_setting_errors_exit_2_with_one_line(tmp_path, capsys, overrides, expected):
    argv = [str(CONFIGS_DIR / "base.yml"), "steps=1", f"base_output_directory={tmp_path}"]
    code = main(argv + overrides)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("data error: "), err
    assert expected in lines[0]


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "tokenizer_type=tiktoken",
            "not supported here: tokenizer_type=tiktoken: read Llama 3's tokenizer.json with "
            "tokenizer_type=huggingface instead",
        ),
        (
            "tokenizer_type=huggingface",
            "tokenizer_type=huggingface needs tokenizer_path= (a tokenizer.json file",
        ),
        ("dataset_type=grain", "dataset_type=grain needs grain_train_files="),
        ("dataset_type=grain grain_train_files=x", "eval_interval=100 needs held-out data"),
        ("grain_worker_count=-1", "grain_worker_count=-1: must be >= 0"),
        ("dataset_split=train", "unknown config key 'dataset_split'"),
        ("packing=false", "packing=false is not supported with dataset_type=text"),
    ],
)
def test_data_keys_are_validated_at_load(override, expected):
    """The data block's keys (MaxText names); `dataset_split` (never read) no longer exists."""
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config([str(CONFIGS_DIR / "base.yml"), *override.split()])


def test_data_shuffle_seed_orders_the_data_and_seed_does_not(tmp_path):
    def first_batch(*overrides):
        argv = [str(CONFIGS_DIR / "base.yml"), "dataset_type=synthetic", *overrides]
        return next(make_data(load_config(argv)).train)["inputs"]

    base = first_batch()
    np.testing.assert_array_equal(first_batch("seed=5"), base)
    assert not np.array_equal(first_batch("data_shuffle_seed=5"), base)
