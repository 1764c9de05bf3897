"""`prepare --format chat|preference` and the trainer's checks of chat shards: bad input is one
`data error:` line naming the file and line (exit 2), nothing compiled; packing keeps masks and
segment ids; truncation and dropping are counted."""

from __future__ import annotations

import json

import numpy as np
import pytest
from chat_fixtures import CONVERSATIONS, byte_level_tokenizer, tokenizer_folder

from MaxText.config import CONFIGS_DIR
from MaxText.data import doc_packing
from MaxText.data.chat_template import fallback_source
from MaxText.data.prepare import main as prepare
from MaxText.train import main as train

BASE = str(CONFIGS_DIR / "base.yml")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("chatdata")
    tok = byte_level_tokenizer(root / "tokenizer.json")
    return {
        "root": root,
        "chatml": tokenizer_folder(root / "chatml", tok, "chatml", fallback_source("chatml")),
        "gemma": tokenizer_folder(root / "gemma", tok, "gemma", fallback_source("gemma")),
        "mistral": tokenizer_folder(root / "mistral", tok, "mistral", fallback_source("mistral")),
        "bare": tokenizer_folder(root / "bare", tok, "chatml", None),
    }


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def run_prepare(tmp_path, records, folder, *extra, kind="chat"):
    data = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out"
    args = ["--format", kind, "--input", data, "--out", str(out), "--quiet"]
    return prepare([*args, "--tokenizer_path", str(folder), *extra]), out


GOOD = {"messages": CONVERSATIONS["one_turn"]}
BAD_CHAT = [
    ({"messages": [{"role": "user", "content": "hi"}]}, "chatml", "has no assistant turn"),
    (
        {"messages": [{"role": "robot", "content": "hi"}, *CONVERSATIONS["one_turn"]]},
        "chatml",
        "has role 'robot'; use one of system, user, assistant",
    ),
    ({"messages": CONVERSATIONS["system"]}, "gemma", "failed: System role not supported"),
    ({"messages": CONVERSATIONS["system"]}, "mistral", "is not prefix-stable"),
    ({"prompt": "hi"}, "chatml", "has neither 'messages' nor 'prompt' and 'completion'"),
]


@pytest.mark.parametrize("record,family,message", BAD_CHAT, ids=lambda x: str(x)[:20])
def test_bad_chat_line_is_one_data_error_naming_file_and_line(
    folders, tmp_path, capsys, record, family, message
):
    code, out = run_prepare(tmp_path, [GOOD, GOOD, record], folders[family])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"data error: {tmp_path / 'in.jsonl'}:3: ") and message in err[0]
    assert not (out / "manifest.json").exists()


def test_template_that_renders_empty_and_missing_template(folders, tmp_path, capsys):
    empty = tmp_path / "empty.jinja"
    empty.write_text("{% for m in messages %}{% endfor %}")
    code, _ = run_prepare(tmp_path, [GOOD], folders["bare"], "--chat_template", str(empty))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and ":1: the conversation renders empty" in err[0], err
    code, _ = run_prepare(tmp_path, [GOOD], folders["bare"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "has no chat_template" in err[0], err
    code, out = run_prepare(tmp_path, [GOOD], folders["bare"], "--chat_template", "chatml")
    assert code == 0 and json.loads((out / "manifest.json").read_text())["kind"] == "chat"


BAD_PAIRS = [
    ({"prompt": "q", "chosen": "a"}, "lacks 'rejected'; a preference pair needs"),
    ({"prompt": "", "chosen": "", "rejected": "b"}, None),  # renders, not empty (template text)
    (
        {"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "user", "content": "a"}],
         "rejected": "b"},
        "'chosen' holds a 'user' turn; it takes assistant turns",
    ),
]  # fmt: skip


def test_bad_pairs_and_identical_pairs(folders, tmp_path, capsys):
    for record, message in BAD_PAIRS:
        if message is None:
            continue
        code, _ = run_prepare(tmp_path, [record], folders["chatml"], kind="preference")
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("data error: "), err
        assert "in.jsonl:1: " in err[0] and message in err[0], err
    empty = tmp_path / "empty_prompt.jinja"  # a template under which the prompt renders empty
    empty.write_text("{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content }}"
                     "{% endif %}{% endfor %}")  # fmt: skip
    code, _ = run_prepare(
        tmp_path, [{"prompt": "q", "chosen": "", "rejected": "b"}], folders["bare"],
        "--chat_template", str(empty), kind="preference",
    )  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "renders empty" in err[0], err
    same = {"prompt": "q", "chosen": "same", "rejected": "same"}
    code, _ = run_prepare(tmp_path, [same, same], folders["chatml"], kind="preference")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "no usable pair (2 pairs skipped" in err[0], err
    good = {"prompt": "q", "chosen": "yes", "rejected": "no"}
    code, out = run_prepare(tmp_path, [same, good, same], folders["chatml"], kind="preference")
    manifest = json.loads((out / "manifest.json").read_text())
    assert code == 0 and manifest["identical_pairs_skipped"] == 2 and manifest["examples"] == 1


def test_trainer_refuses_other_template_or_tokenizer_before_compiling(folders, tmp_path, capsys):
    code, out = run_prepare(tmp_path, [GOOD] * 4, folders["chatml"])
    assert code == 0
    keys = [
        BASE, "use_sft=true", "dataset_type=grain", f"grain_train_files={out}/train-*",
        "vocab_size=512", "steps=1", "eval_interval=0", f"base_output_directory={tmp_path}",
    ]  # fmt: skip
    capsys.readouterr()
    other = tmp_path / "other"  # the same tokenizer.json, Gemma's template
    tokenizer_folder(
        other, folders["chatml"] / "tokenizer.json", "chatml", fallback_source("gemma")
    )
    hf = "tokenizer_type=huggingface"
    assert train([*keys, f"tokenizer_path={other}/tokenizer.json", hf]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "prepared with another chat template" in err[-1], err
    retrained = byte_level_tokenizer(tmp_path / "t2" / "tokenizer.json", vocab_size=380)
    assert train([*keys, f"tokenizer_path={retrained}", hf]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not the tokenizer the shards were written with" in err[-1], err
    assert train([*keys[:1], *keys[2:]]) == 2  # use_sft=false on chat shards
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds chat data" in err[-1] and "use_sft=true" in err[-1], err
    assert not (tmp_path / "checkpoints").exists()


def test_packing_keeps_masks_and_segments_and_counts_cut_examples():
    def example(n, trained):
        return np.arange(1, n + 1, dtype=np.int32), np.asarray(
            [int(i in trained) for i in range(n)], np.uint8
        )

    examples = [example(5, {3, 4}), example(12, {8, 11}), example(4, {2}), example(9, {1})]
    rows = doc_packing.pack_examples(examples, 8, packing=True, pad_id=0, truncation="right")
    # 5 tokens (4 targets) + 4 tokens (3 targets) share row 0; 12 is cut to 9 (its target 11
    # is lost, 8 stays); 9 tokens fit exactly (8 targets)
    assert rows["inputs"].shape == (3, 8)
    np.testing.assert_array_equal(rows["inputs_segmentation"][0], [1, 1, 1, 1, 2, 2, 2, 0])
    np.testing.assert_array_equal(rows["inputs_position"][0], [0, 1, 2, 3, 0, 1, 2, 0])
    np.testing.assert_array_equal(rows["targets_mask"][0], [0, 0, 1, 1, 0, 1, 0, 0])
    np.testing.assert_array_equal(rows["targets_mask"][1], [0, 0, 0, 0, 0, 0, 0, 1])
    np.testing.assert_array_equal(rows["targets_mask"][2], [1, 0, 0, 0, 0, 0, 0, 0])
    assert rows["examples_truncated"].tolist() == [1, 0, 0]
    assert rows["examples_dropped"].tolist() == [0, 0, 0]
    dropped = doc_packing.pack_examples(examples, 8, packing=True, pad_id=0, truncation="drop")
    assert dropped["inputs"].shape == (2, 8) and dropped["examples_dropped"].sum() == 1
    everything = doc_packing.pack_examples(
        examples, 8, packing=False, pad_id=0, truncation="right", completion_only=False
    )
    assert everything["inputs"].shape == (4, 8)
    np.testing.assert_array_equal(everything["targets_mask"][0], [1, 1, 1, 1, 0, 0, 0, 0])
    pairs = doc_packing.pack_pairs(
        [(examples[0], examples[2]), (examples[1], examples[3])], 8, pad_id=0, truncation="drop"
    )
    assert pairs["inputs"].shape == (2, 8) and pairs["examples_dropped"].sum() == 1
    np.testing.assert_array_equal(pairs["inputs"][1, :3], [1, 2, 3])  # rejected of pair 0


def test_text_prepare_reads_a_hugging_face_tokenizer(folders, tmp_path):
    """--format text with --tokenizer_path naming a tokenizer.json folder: documents are its ids
    (BOS/EOS of its tokenizer_config.json), and the grain loader reads them back with it."""
    from MaxText.config import load_config
    from MaxText.data import make_data
    from MaxText.data.tokenizer import load_huggingface

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("the quick brown fox jumps over the lazy dog")
    out = tmp_path / "out"
    args = ["--input", str(tmp_path / "docs"), "--out", str(out), "--quiet"]
    assert prepare([*args, "--tokenizer_path", str(folders["gemma"])]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["tokenizer"], manifest["tokenizer_type"]) == ("tokenizer.json", "huggingface")
    tok = load_huggingface(str(folders["gemma"]))
    want = [tok.bos_id, *tok.encode("the quick brown fox jumps over the lazy dog"), tok.eos_id]
    config = load_config([
        BASE, "dataset_type=grain", f"grain_train_files={out}/train-*", "vocab_size=512",
        "max_target_length=32", "global_batch_size=1", "eval_interval=0", "grain_worker_count=0",
    ])  # fmt: skip
    data = make_data(config)
    row = next(data.train)
    data.close()
    n = len(want) - 1
    assert row["inputs"][0, :n].tolist() == want[:-1] and row["targets"][0, :n].tolist() == want[1:]
