"""`--help` / `-h` on every entry point: exit 0, the usage line, and the config keys the tool reads,
grouped, with type, default and doc from configs/base.yml; a word filters the keys. Every other
bad argument keeps its one-line error. In-process (one subprocess for the train.py script)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from MaxText.config import tool_help
from MaxText.config.key_docs import key_docs

REPO = Path(__file__).resolve().parent.parent


def _main(tool: str):
    if tool == "train":
        from MaxText.train import main
    elif tool == "MaxText.generate":
        from MaxText.generate import main
    elif tool == "MaxText.plan":
        from MaxText.plan import main
    elif tool == "MaxText.launch":
        from MaxText.launch import main
    elif tool == "MaxText.to_maxtext":
        from MaxText.to_maxtext import main
    elif tool == "MaxText.to_huggingface":
        from MaxText.to_huggingface import main
    else:
        from MaxText.data.prepare import main
    return main


def listed_keys(out: str) -> list[str]:
    """Key names in a help text: the lines `  name: type = default ...`."""
    return re.findall(r"^  ([a-z_0-9]+): (?:int|float|bool|str|list of [a-z]+) = ", out, re.M)


# tool -> (start of the usage line, its own flags, keys it reads, keys it does not read)
CASES = {
    "train": (
        "usage: python train.py configs/base.yml [key=value ...]\n"
        "       python -m MaxText.train configs/base.yml",
        [],
        ["steps", "pipeline_schedule", "learning_rate", "grain_train_files", "emb_dim"],
        ["prompt", "hf_output_path"],
    ),
    "MaxText.generate": (
        "usage: python -m MaxText.generate configs/base.yml run_name=RUN",
        [],
        ["prompt", "decode_sampling_strategy", "run_name", "load_parameters_path", "emb_dim"],
        ["ici_data_parallelism", "learning_rate", "scan_layers", "hf_output_path"],
    ),
    "MaxText.plan": (
        "usage: python -m MaxText.plan configs/base.yml [key=value ...]",
        ["--hardware {h100,h200,a100,cpu}", "--json", "--memory-gb", "--efficiency"],
        ["pipeline_schedule", "remat_policy", "pipeline_stage_layers", "emb_dim"],
        ["prompt", "checkpoint_period", "grain_train_files", "log_period"],
    ),
    "MaxText.launch": (
        "usage: python -m MaxText.launch --num_processes N",
        ["--num_processes NUM_PROCESSES", "--timeout"],
        ["coordinator_address", "num_processes", "process_id"],
        ["steps"],
    ),
    "MaxText.to_maxtext": (
        "usage: python -m MaxText.to_maxtext configs/base.yml hf_model_path=DIR",
        [],
        ["hf_model_path", "base_output_directory", "weight_dtype"],
        ["hf_output_path", "steps"],
    ),
    "MaxText.to_huggingface": (
        "usage: python -m MaxText.to_huggingface configs/base.yml load_parameters_path=CKPT",
        [],
        ["hf_output_path", "hf_output_dtype", "hf_max_shard_mb", "load_parameters_path"],
        ["hf_model_path", "steps"],
    ),
    "MaxText.data.prepare": (
        "usage: python -m MaxText.data.prepare [-h] [--format {text,chat,preference}]",
        ["--vocab_size VOCAB_SIZE", "--add_bos true|false", "--shard_size"],
        ["dataset_type", "grain_train_files", "packing"],
        ["steps"],
    ),
}


@pytest.mark.parametrize("tool", list(CASES))
def test_every_entry_point_answers_help(tool, capsys, tmp_path, monkeypatch):
    usage, flags, reads, ignores = CASES[tool]
    monkeypatch.chdir(tmp_path)
    assert _main(tool)(["--help"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(usage) and err == ""
    for flag in flags:
        assert flag in out
    listed = listed_keys(out)
    assert set(reads) <= set(listed) and not set(ignores) & set(listed)
    assert listed == [k.name for k in tool_help.tool_keys(tool_help.TOOLS[tool])]
    groups = {k.group for k in key_docs() if k.name in listed}
    assert all(f"\n{g}:\n" in out for g in groups)  # grouped under base.yml's titles
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing written
    assert _main(tool)(["-h"]) == 0 and capsys.readouterr().out == out


def _presets_setting(key: str) -> int:
    """How many configs/models/*.yml set `key` (counted here, independently of key_docs)."""
    presets = (REPO / "configs" / "models").glob("*.yml")
    return sum(1 for p in presets if re.search(rf"^{key}:", p.read_text(), re.M))


def test_a_key_shows_type_default_range_and_its_base_yml_comment(capsys):
    assert _main("train")(["--help"]) == 0
    out = capsys.readouterr().out
    assert (  # configs/base.yml: `gradient_clipping_threshold: 1.0  # global-norm clipping; ...`
        "  gradient_clipping_threshold: float = 1.0  [>= 0]\n"
        "      global-norm clipping; 0 disables it\n"
    ) in out
    assert (  # a key the default preset (tiny) sets, and its range with -1 and auto
        f"  emb_dim: int = 128  [>= 1]  (set by {_presets_setting('emb_dim')} model presets; "
        "model_name=tiny sets 128)\n"
    ) in out
    assert "  num_pipeline_microbatches: int = -1  [>= 1; -1: automatic; auto: decided" in out


def test_a_word_keeps_only_the_keys_whose_name_or_doc_contains_it(capsys):
    assert _main("train")(["--help", "pipeline"]) == 0
    out = capsys.readouterr().out
    listed = listed_keys(out)
    want = [
        k.name
        for k in tool_help.tool_keys(tool_help.TOOLS["train"])
        if "pipeline" in k.name or "pipeline" in k.doc.lower()
    ]
    assert listed == want and len(listed) >= 8
    assert {"num_pipeline_microbatches", "dcn_pipeline_parallelism"} <= set(listed)
    assert "pipeline_hang_timeout_s" in listed and "learning_rate" not in listed
    assert "config keys it reads (matching pipeline):" in out
    # any case; in the name or only in the doc (vocab_size, add_bos, add_eos: "tokenizer's")
    assert _main("train")(["configs/base.yml", "--help", "TOKENIZER"]) == 0
    assert listed_keys(capsys.readouterr().out) == [
        "vocab_size",
        "tokenizer_path",
        "tokenizer_type",
        "add_bos",
        "add_eos",
        "chat_template",  # "the tokenizer folder's chat_template.jinja ..."
    ]
    assert _main("MaxText.generate")(["--help", "no-such-word"]) == 0
    assert capsys.readouterr().out.endswith("no config key it reads matches 'no-such-word'\n")


def test_other_bad_arguments_keep_their_one_line_errors(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    yaml_first = "config error: the first argument must be a YAML config file, got '--hepl'"
    for tool, line in (
        ("train", yaml_first),
        ("MaxText.generate", yaml_first),
        ("MaxText.to_maxtext", "config error: to_maxtext needs hf_model_path=<a Hugging Face"),
        ("MaxText.to_huggingface", yaml_first),
    ):
        assert _main(tool)(["--hepl"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(line)
    base = str(REPO / "configs" / "base.yml")
    assert _main("MaxText.plan")([base, "--bogus"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "config error: expected key=value on the command line, got '--bogus'"
    ]
    with pytest.raises(SystemExit) as e:  # one `usage error:` line on stderr (issue 36)
        _main("MaxText.launch")(["--num_processes", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("usage error: no `--`")
    with pytest.raises(SystemExit) as e:
        _main("MaxText.data.prepare")(["--input", "x"])
    assert e.value.code == 2 and "the following arguments are required: --out" in (
        capsys.readouterr().err
    )


def test_the_tools_table_names_only_existing_groups_and_keys():
    assert tool_help.check_tools() == []
    broken = tool_help.Tool(usage=("x",), about="x", groups=("no such group",), keys=("nokey",))
    tool_help.TOOLS["broken"] = broken
    try:
        assert tool_help.check_tools() == [
            "broken: no group 'no such group' in base.yml",
            "broken: no key 'nokey' in base.yml",
        ]
    finally:
        del tool_help.TOOLS["broken"]


def test_help_words_are_the_plain_tokens_after_the_flag():
    assert tool_help.requested(["configs/base.yml", "steps=3"]) is None
    assert tool_help.requested(["--help"]) == []
    assert tool_help.requested(["configs/base.yml", "-h", "pipeline", "steps=3"]) == ["pipeline"]
    assert tool_help.requested(["--num_processes", "2", "--", "configs/base.yml", "-h"]) is None
    assert tool_help.requested(["prompt=--help"]) is None


def test_the_train_py_script_answers_help():
    """The script itself (its own `__main__`, the venv check first), as a user types it."""
    proc = subprocess.run(
        [sys.executable, "train.py", "--help", "checkpoint"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python train.py configs/base.yml [key=value ...]")
    listed = listed_keys(proc.stdout)
    assert {"enable_checkpointing", "checkpoint_period", "async_checkpointing"} <= set(listed)
    assert "steps" not in listed
