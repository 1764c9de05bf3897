"""docs/reference/config.md is what `MaxText.config.reference` generates from configs/base.yml and
`Config`'s fields, and every key has a doc there."""

from __future__ import annotations

import pytest

from MaxText.config import key_docs as kd
from MaxText.config import reference
from MaxText.config.loader import KEYS


def test_the_committed_page_is_what_the_code_generates():
    committed = reference.REFERENCE_PAGE.read_text()
    assert committed == reference.render(), (
        "docs/reference/config.md is out of date: run python -m MaxText.config.reference"
    )
    assert reference.main(["--check"]) == 0


def test_every_declared_key_is_documented_once_in_base_yml_order():
    docs = kd.key_docs()  # raises KeyDocError for a key without a doc or in one place only
    assert sorted(k.name for k in docs) == sorted(KEYS)
    assert len({k.name for k in docs}) == len(docs)
    assert all(k.doc and k.group for k in docs)
    text = reference.render()
    for k in docs:  # every key has its row and its anchor
        assert f'<a id="{k.name}"></a>`{k.name}`' in text


def test_a_row_carries_the_fields_declaration_and_base_yml_comment():
    by_name = {k.name: k for k in kd.key_docs()}
    mb = by_name["num_pipeline_microbatches"]  # key(ge=1, minus_one="automatic", auto=True)
    assert (mb.type, mb.default, mb.group) == ("int", "-1", "parallelism (one host)")
    assert mb.range == ">= 1; -1: automatic; auto: decided by the planner"
    assert mb.doc.startswith("microbatches per step; -1 -> 2 x stages when pipelined")
    sched = by_name["pipeline_schedule"]
    assert sched.range.endswith("zero_bubble | dualpipev | auto")
    warmup = by_name["warmup_steps_fraction"]  # key(ge=0, le=1)
    assert (warmup.type, warmup.range) == ("float", ">= 0, <= 1")
    # a doc continued on indented comment lines below the key
    assert by_name["attention"].doc.endswith("O(L x block) memory, any backend)")
    row = next(line for line in reference.render().splitlines() if '"attention"' in line)
    assert "dot_product (einsum, full [L, L] scores) \\| autoselected" in row  # | escaped


def test_keys_a_preset_sets_are_marked_with_the_default_presets_value():
    by_name = {k.name: k for k in kd.key_docs()}
    presets = kd.all_presets()
    assert by_name["emb_dim"].presets == presets and by_name["emb_dim"].preset_default == "128"
    llama31 = tuple(p for p in presets if p.startswith("llama3.1"))
    assert by_name["rope_type"].presets == llama31 and by_name["rope_type"].preset_default is None
    assert by_name["steps"].presets == ()
    lines = reference.render().splitlines()
    rows = {line.split("`")[1]: line for line in lines if "<a id=" in line}
    assert "| all (tiny: `128`) |" in rows["emb_dim"]
    assert "| llama3.1-405b, llama3.1-70b, llama3.1-8b |" in rows["rope_type"]


def _with_base_yml(monkeypatch, tmp_path, text):
    path = tmp_path / "base.yml"
    path.write_text(text)
    monkeypatch.setattr(kd, "BASE_YML", path)
    kd.key_docs.cache_clear()


@pytest.fixture
def base_text():
    yield kd.BASE_YML.read_text()
    kd.key_docs.cache_clear()


def test_a_key_without_doc_fails(monkeypatch, tmp_path, base_text):
    line = next(x for x in base_text.splitlines() if x.startswith("adam_b2:"))
    _with_base_yml(monkeypatch, tmp_path, base_text.replace(line, "adam_b2: 0.95"))
    with pytest.raises(kd.KeyDocError, match=r"^adam_b2: no doc; write one"):
        kd.key_docs()


def test_a_key_only_in_config_or_only_in_base_yml_fails(monkeypatch, tmp_path, base_text):
    without = "\n".join(x for x in base_text.splitlines() if not x.startswith("adam_b2:"))
    _with_base_yml(monkeypatch, tmp_path, without)
    with pytest.raises(kd.KeyDocError, match=r"^adam_b2: declared in Config but not in"):
        kd.key_docs()
    _with_base_yml(monkeypatch, tmp_path, base_text + "\nadam_b3: 0.9  # a third beta\n")
    with pytest.raises(kd.KeyDocError, match=r"^adam_b3: in .* but not declared in Config"):
        kd.key_docs()


def test_a_changed_doc_makes_the_committed_page_stale(monkeypatch, tmp_path, base_text):
    old = "# peak learning rate"
    assert base_text.count(old) == 1
    _with_base_yml(monkeypatch, tmp_path, base_text.replace(old, "# the peak learning rate"))
    assert reference.render() != reference.REFERENCE_PAGE.read_text()
    assert reference.main(["--check"]) == 1


def test_comments_and_quotes_are_parsed_as_yaml_writes_them():
    keys, notes = kd.parse_base_yml(
        "# header, not a group\n"
        "# ------ first group\n"
        "# a note about the group\n"
        'a: "x # y"   # the doc of a\n'
        "b: 1\n"
        "              # continued doc of b\n"
        "# ------ second (with parens)\n"
        "c: ''  # c's doc\n"
    )
    assert [(k["name"], k["group"], k["default"], k["doc"]) for k in keys] == [
        ("a", "first group", '"x # y"', "the doc of a"),
        ("b", "first group", "1", "continued doc of b"),
        ("c", "second (with parens)", "''", "c's doc"),
    ]
    assert notes == {"first group": "a note about the group", "second (with parens)": ""}
    assert kd.group_id("second (with parens)") == "second"
