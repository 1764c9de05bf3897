"""Data settings that cannot work end the run with exit code 2 and one line (issue #11, item 5).

Each case runs the trainer's entry point `MaxText.train.main` in-process and checks the return
code and that stderr holds exactly one line naming the setting (no traceback).
"""

import pytest

from MaxText.config import CONFIGS_DIR
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
