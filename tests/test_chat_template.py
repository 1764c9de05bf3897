"""Chat templates and loss masks against transformers 4.47.1, which nobody here wrote.

Rendering: `ChatTemplate.render` equals `apply_chat_template(..., tokenize=False)` string for
string, and our tokenizer's ids of it equal `apply_chat_template(..., tokenize=True)`, for the four
committed fallbacks (each the published file: sha256 pinned below) and a template read from a
`tokenizer_config.json` that uses the generation tag, loop controls, `tojson` and
`strftime_now`; with and without a system turn, with and without the generation prompt.
transformers' `strftime_now` reads the clock: it is pinned to the date we render with.

Masks: the trained tokens of `prepare` (found by prefix renders and the tokenizer's offsets) equal
(a) transformers' `return_assistant_tokens_mask` for a ChatML template with `{% generation %}`
around each assistant turn's content and end-of-turn token (its own span tracking and
`char_to_token`), and (b) for every fallback, the tokens overlapping the spans the test finds by
searching the rendered text for each assistant turn's content (as the template writes it,
trimmed or not) followed by its end-of-turn token.
"""

from __future__ import annotations

import datetime
import hashlib
import json

import numpy as np
import pytest
from chat_fixtures import (
    CONVERSATIONS,
    byte_level_tokenizer,
    hf_tokenizer,
    tokenizer_folder,
)

from MaxText.data.chat import (
    Conversation,
    chat_conversation,
    tokenize_example,
    trained_spans,
)
from MaxText.data.chat_template import (
    FALLBACKS,
    TemplateError,
    fallback_source,
    find_chat_template,
)
from MaxText.data.errors import DataError
from MaxText.data.tokenizer import load_huggingface

DATE = datetime.date(2024, 7, 26)
PUBLISHED_SHA256 = {  # the committed files (MaxText/data/chat_templates/SOURCES.md)
    "chatml": "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f",
    "llama3": "5816fce10444e03c2e9ee1ef8a4a1ea61ae7e69e438613f3b17b69d0426223a4",
    "mistral": "e16746b40344d6c5b5265988e0328a0bf7277be86f1c335156eae07e29c82826",
    "gemma": "ecd6ae513fe103f0eb62e8ab5bfa8d0fe45c1074fa398b089c93a7e70c15cfd6",
}
END_OF_TURN = {
    "chatml": "<|im_end|>",
    "llama3": "<|eot_id|>",
    "mistral": "</s>",
    "gemma": "<end_of_turn>",
}
TRIMS_CONTENT = {"chatml": False, "llama3": True, "mistral": True, "gemma": True}
# What the template writes between the generation prompt and the content: Mistral's " " after
# [/INST] is the model's to generate (its prompt ends at [/INST]), so it is trained too.
LEAD = {"chatml": "", "llama3": "", "mistral": " ", "gemma": ""}
# A template as a tokenizer_config.json may hold one: indented block tags on their own lines
# (what trim_blocks / lstrip_blocks remove), generation tags, loop controls, tojson, strftime_now.
CONFIG_TEMPLATE = """{{ bos_token }}
{% for m in messages %}
    {% if m['role'] == 'system' %}
{{ '<|im_start|>system\\n' + m['content'] + ' ' + strftime_now('%d %B %Y') + '<|im_end|>\\n' }}
        {% continue %}
    {% endif %}
    {% if m['role'] == 'assistant' %}
{{ '<|im_start|>assistant\\n' }}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}
    {% else %}
{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' }}
    {% endif %}
    {% if loop.index > 10 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
{{ '<|im_start|>assistant\\n' }}
{%- endif %}
{{ '' if messages | length > 0 else ({'a': 'é<'} | tojson) }}"""


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tokenizer folder per fallback (template from the fallback file) and one whose
    tokenizer_config.json holds CONFIG_TEMPLATE."""
    root = tmp_path_factory.mktemp("chat")
    tok = byte_level_tokenizer(root / "tokenizer.json")
    out = {f: tokenizer_folder(root / f, tok, f, fallback_source(f)) for f in FALLBACKS}
    out["config"] = tokenizer_folder(root / "config", tok, "llama3", CONFIG_TEMPLATE)
    return out


@pytest.fixture
def fixed_clock(monkeypatch):
    """transformers' strftime_now reads datetime.now(): pinned to DATE."""
    import transformers.utils.chat_template_utils as ctu

    class Fixed(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(DATE.year, DATE.month, DATE.day)

    monkeypatch.setattr(ctu, "datetime", Fixed)


def ours(folder, fallback=""):
    tokenizer = load_huggingface(str(folder))
    return tokenizer, find_chat_template(folder, fallback, tokenizer, DATE)


def test_fallbacks_are_the_published_files():
    for name in FALLBACKS:
        digest = hashlib.sha256(fallback_source(name).encode()).hexdigest()
        assert digest == PUBLISHED_SHA256[name], name


@pytest.mark.parametrize("name", [*FALLBACKS, "config"])
def test_rendering_equals_transformers(folders, fixed_clock, name):
    """String for string and token for token; a template that raises raises in both."""
    tokenizer, template = ours(folders[name])
    hf = hf_tokenizer(folders[name])
    compared = 0
    for conversation in CONVERSATIONS.values():
        for generation in (False, True):
            try:
                want = hf.apply_chat_template(
                    conversation, tokenize=False, add_generation_prompt=generation
                )
            except Exception as e:  # noqa: BLE001 (jinja2's TemplateError from transformers)
                with pytest.raises(TemplateError, match="System role not supported"):
                    template.render(conversation, generation)
                assert "System role not supported" in str(e)
                continue
            got = template.render(conversation, generation)
            assert got == want, (name, conversation, generation)
            ids = hf.apply_chat_template(
                conversation, tokenize=True, add_generation_prompt=generation
            )
            assert tokenizer.encode(got) == ids
            compared += 1
    with_system = any(m["role"] == "system" for m in CONVERSATIONS["system"])
    assert with_system and compared == (4 if name == "gemma" else 6)


def test_strftime_now_renders_the_fixed_date(folders):
    tokenizer, template = ours(folders["llama3"])
    assert "Today Date: 26 Jul 2024" in template.render(CONVERSATIONS["one_turn"], False)
    other = find_chat_template(folders["llama3"], "", tokenizer, datetime.date(2025, 1, 2))
    assert "Today Date: 02 Jan 2025" in other.render(CONVERSATIONS["one_turn"], False)


def _mask(folder, conversation_record, fallback=""):
    tokenizer, template = ours(folder, fallback)
    conversation = chat_conversation(conversation_record, "test:1")
    text, spans = trained_spans(template, conversation, "test:1")
    return text, tokenize_example(tokenizer, text, spans), tokenizer


def test_mask_equals_transformers_assistant_mask(folders, fixed_clock):
    """transformers tracks `{% generation %}` blocks and maps them through char_to_token."""
    hf = hf_tokenizer(folders["config"])
    for conversation in CONVERSATIONS.values():
        text, example, _ = _mask(folders["config"], {"messages": conversation})
        out = hf.apply_chat_template(
            conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        np.testing.assert_array_equal(example.tokens, out["input_ids"])
        np.testing.assert_array_equal(example.mask, out["assistant_masks"])
        assert 0 < example.mask.sum() < example.mask.size


@pytest.mark.parametrize("name", FALLBACKS)
def test_mask_equals_spans_found_by_searching_the_text(folders, name):
    """Each assistant turn: its content (trimmed where the template trims) then the end-of-turn
    token, searched for in the rendering after the previous turn."""
    for key, conversation in CONVERSATIONS.items():
        if name in ("gemma", "mistral") and key == "system":
            continue  # Gemma 2 refuses a system turn, Mistral v0.3 moves it (test_bad_templates)
        text, example, tokenizer = _mask(folders[name], {"messages": conversation})
        spans, cursor = [], 0
        for m in conversation:
            if m["role"] != "assistant":
                continue
            content = m["content"].strip() if TRIMS_CONTENT[name] else m["content"]
            piece = LEAD[name] + content + END_OF_TURN[name]
            start = text.index(piece, cursor)
            spans.append((start, start + len(piece)))
            cursor = start + len(piece)
        ids, offsets = tokenizer.encode_with_offsets(text)
        want = [int(any(s < b and e > a for a, b in spans)) for s, e in offsets]
        np.testing.assert_array_equal(example.mask, want)
        assert example.mask.sum() >= len(spans) * 2


def test_prompt_completion_trains_only_the_completion(folders):
    text, example, tokenizer = _mask(
        folders["chatml"], {"prompt": "Count to three.", "completion": "One, two, three."}
    )
    trained = tokenizer._tok.decode(example.tokens[example.mask == 1].tolist(), False)
    assert trained == "One, two, three.<|im_end|>"


def test_bad_templates(folders):
    """A template that raises, one that is not prefix-stable, one that renders empty."""
    record = {"messages": CONVERSATIONS["system"]}
    with pytest.raises(DataError, match=r"^test:1: the chat template .* System role not supported"):
        _mask(folders["gemma"], record)
    # Mistral v0.3 writes the system text into the user turn that ends the conversation: the
    # prompt rendered for the assistant's turn has it, the whole conversation does not.
    with pytest.raises(DataError, match=r"^test:1: the chat template .* not prefix-stable"):
        _mask(folders["mistral"], record)
    tokenizer = load_huggingface(str(folders["chatml"]))
    empty = find_chat_template(folders["chatml"], "", tokenizer)
    empty.source = "{% for m in messages %}{% endfor %}"
    conversation = chat_conversation(record, "test:1")
    with pytest.raises(DataError, match="renders empty"):
        trained_spans(empty, conversation, "test:1")
    # Qwen 3 style: earlier assistant turns lose their <think> block once a later turn exists
    rewriting = find_chat_template(folders["chatml"], "", tokenizer)
    rewriting.source = (
        "{% for m in messages %}{% set c = m['content'] %}{% if m['role'] == 'assistant' and "
        "not loop.last %}{% set c = c.split('</think>')[-1] %}{% endif %}{{ m['role'] + ': ' "
        "+ c + '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    thinking = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>x</think>b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "<think>y</think>d"},
    ]
    with pytest.raises(DataError, match="not prefix-stable"):
        trained_spans(rewriting, Conversation(tuple(thinking), (1, 3)), "test:1")


def test_no_template_and_no_fallback_is_one_line(tmp_path, folders):
    folder = tokenizer_folder(
        tmp_path / "bare", folders["chatml"] / "tokenizer.json", "chatml", None
    )
    tokenizer = load_huggingface(str(folder))
    with pytest.raises(DataError, match=r"has no chat_template .*chatml\|llama3\|mistral\|gemma"):
        find_chat_template(folder, "", tokenizer)
    assert find_chat_template(folder, "chatml", tokenizer).origin == "fallback chatml"
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert "chat_template" not in config
