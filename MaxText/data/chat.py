"""Chat and preference examples: JSONL records -> rendered conversations -> tokens and a loss mask.

Record formats (one JSON object per line):

- chat, Hugging Face / OpenAI messages: `{"messages": [{"role": "system"|"user"|"assistant",
  "content": "..."}, ...]}`, at least one assistant turn; every assistant turn is trained.
- chat, prompt / completion (TRL's names): `{"prompt": "...", "completion": "..."}` is the
  conversation [user: prompt, assistant: completion]; `{"prompt": [messages], "completion":
  [assistant messages]}` is prompt + completion, and only the completion's turns are trained.
- preference (TRL's two formats): `{"prompt": "...", "chosen": "...", "rejected": "..."}` (the
  prompt is one user turn, each response one assistant turn), or `{"prompt": [messages],
  "chosen": [assistant messages], "rejected": [assistant messages]}`. Each side is the prompt
  followed by its response; the response's tokens are the scored ones.

Trained tokens (the loss mask) are found by rendering, never by searching for the content: for
each trained assistant turn i, its span starts where the rendering of the conversation before it
with the generation prompt ends (`render(m[:i], add_generation_prompt=True)`) and ends where the
rendering of the conversation up to and including it ends (`render(m[:i+1])`), without trailing
whitespace: the assistant's content as the template writes it (trimmed or not) plus the
end-of-turn text the template puts right after it (`<|im_end|>`, `<|eot_id|>`, `</s>`,
`<end_of_turn>`). Both renderings must be string prefixes of the full rendering, otherwise the
template rewrites earlier turns (Qwen 3's drops earlier `<think>` blocks; Mistral v0.3 moves the
system text into the last user turn) and the example is refused. The full rendering is tokenized
once and a token is trained when its character span (the tokenizer's offsets) overlaps a trained
span. With `train_on_completion_only=false` (MaxText's `sft_train_on_completion_only`) every token
after the first is trained.

Records in the shards (`encode_example`, `encode_pair`): an example is its token ids as
little-endian `dtype` followed by one mask byte per token; a pair is a uint32 header (chosen and
rejected lengths) followed by both sides' ids, then both sides' mask bytes, so a pair is one
record (one shard, one packing window, adjacent rows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from MaxText.data.chat_template import ChatTemplate, TemplateError
from MaxText.data.errors import DataError

ROLES = ("system", "user", "assistant")


@dataclasses.dataclass(frozen=True)
class Conversation:
    """Messages and the indices of the assistant turns whose tokens are trained (scored)."""

    messages: tuple[dict[str, str], ...]
    trained: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Example:
    """A tokenized conversation: ids and, per id, 1 if it is trained (a target of the loss)."""

    tokens: np.ndarray  # int32[n]
    mask: np.ndarray  # uint8[n]
    text: str = ""


def _messages(value: Any, where: str, field: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: '{field}' must be a non-empty list of messages")
    out = []
    for k, m in enumerate(value):
        if not isinstance(m, Mapping) or not isinstance(m.get("content"), str):
            raise DataError(
                f"{where}: {field}[{k}] must be an object with a string 'role' and 'content'"
            )
        role = m.get("role")
        if role not in ROLES:
            raise DataError(
                f"{where}: {field}[{k}] has role {role!r}; use one of {', '.join(ROLES)}"
            )
        out.append({"role": role, "content": m["content"]})
    return out


def _turn(role: str, value: Any, where: str, field: str) -> list[dict[str, str]]:
    """A string as one message of `role`, or a list of messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return _messages(value, where, field)


def chat_conversation(record: Any, where: str) -> Conversation:
    """The conversation of a chat record (see the module doc); DataError naming `where`."""
    if not isinstance(record, Mapping):
        raise DataError(f"{where}: is not a JSON object")
    if "messages" in record:
        messages = _messages(record["messages"], where, "messages")
        trained = tuple(i for i, m in enumerate(messages) if m["role"] == "assistant")
        if not trained:
            raise DataError(f"{where}: 'messages' has no assistant turn, so nothing to train on")
        return Conversation(tuple(messages), trained)
    if "prompt" in record and "completion" in record:
        prompt = _turn("user", record["prompt"], where, "prompt")
        completion = _turn("assistant", record["completion"], where, "completion")
        _only_assistant(completion, where, "completion")
        n = len(prompt)
        return Conversation(tuple(prompt + completion), tuple(range(n, n + len(completion))))
    raise DataError(f"{where}: has neither 'messages' nor 'prompt' and 'completion'")


def _only_assistant(messages: list[dict[str, str]], where: str, field: str) -> None:
    bad = [m["role"] for m in messages if m["role"] != "assistant"]
    if bad:
        raise DataError(f"{where}: '{field}' holds a {bad[0]!r} turn; it takes assistant turns")


def preference_conversations(record: Any, where: str) -> tuple[Conversation, Conversation]:
    """(chosen, rejected) conversations of a preference record (see the module doc)."""
    if not isinstance(record, Mapping):
        raise DataError(f"{where}: is not a JSON object")
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in record]
    if missing:
        raise DataError(
            f"{where}: lacks {', '.join(repr(k) for k in missing)}; a preference pair needs "
            "'prompt', 'chosen' and 'rejected'"
        )
    prompt = _turn("user", record["prompt"], where, "prompt")
    sides = []
    for side in ("chosen", "rejected"):
        response = _turn("assistant", record[side], where, side)
        _only_assistant(response, where, side)
        n = len(prompt)
        sides.append(Conversation(tuple(prompt + response), tuple(range(n, n + len(response)))))
    return sides[0], sides[1]


def _render(template: ChatTemplate, messages, generation: bool, where: str) -> str:
    try:
        return template.render(messages, add_generation_prompt=generation)
    except TemplateError as e:
        raise DataError(f"{where}: the chat template ({template.origin}) failed: {e}") from None


def trained_spans(
    template: ChatTemplate, conversation: Conversation, where: str
) -> tuple[str, list[tuple[int, int]]]:
    """(full rendering, [start, end) character spans of the trained turns); see the module doc."""
    messages = list(conversation.messages)
    text = _render(template, messages, False, where)
    if not text.strip():
        raise DataError(f"{where}: the conversation renders empty with {template.origin}")
    spans = []
    for i in conversation.trained:
        before = _render(template, messages[:i], True, where) if i else ""
        through = _render(template, messages[: i + 1], False, where)
        for prefix, what in ((before, "before"), (through, "through")):
            if not text.startswith(prefix):
                raise DataError(
                    f"{where}: the chat template ({template.origin}) is not prefix-stable: the "
                    f"conversation rendered {what} turn {i} is not the start of the whole "
                    "conversation's rendering (it rewrites earlier turns); it cannot mark the "
                    "assistant's tokens, use another template"
                )
        end = len(through.rstrip())
        spans.append((len(before), max(end, len(before))))
    return text, spans


def tokenize_example(
    tokenizer: Any, text: str, spans: Sequence[tuple[int, int]], *, add_bos: bool = False
) -> Example:
    """`text` tokenized once; a token is trained if its character span overlaps a trained span.
    `add_bos`: a BOS id first (never trained), for templates that do not write one."""
    ids, offsets = tokenizer.encode_with_offsets(text)
    mask = np.zeros(len(ids), np.uint8)
    for k, (s, e) in enumerate(offsets):
        if e > s and any(s < end and e > start for start, end in spans):
            mask[k] = 1
    if add_bos and tokenizer.bos_id >= 0:
        ids = [tokenizer.bos_id, *ids]
        mask = np.concatenate([np.zeros(1, np.uint8), mask])
    return Example(np.asarray(ids, np.int32), mask, text)


def encode_example(example: Example, dtype: np.dtype) -> bytes:
    """An example as one shard record (see the module doc)."""
    le = np.dtype(dtype).newbyteorder("<")
    return example.tokens.astype(le).tobytes() + example.mask.astype(np.uint8).tobytes()


def decode_example(record: bytes, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(int32 ids, uint8 mask) of an `encode_example` record."""
    le = np.dtype(dtype).newbyteorder("<")
    n = len(record) // (le.itemsize + 1)
    tokens = np.frombuffer(record, le, count=n).astype(np.int32)
    return tokens, np.frombuffer(record, np.uint8, offset=n * le.itemsize, count=n).copy()


def encode_pair(chosen: Example, rejected: Example, dtype: np.dtype) -> bytes:
    le = np.dtype(dtype).newbyteorder("<")
    header = np.asarray([chosen.tokens.size, rejected.tokens.size], "<u4").tobytes()
    ids = np.concatenate([chosen.tokens, rejected.tokens]).astype(le).tobytes()
    masks = np.concatenate([chosen.mask, rejected.mask]).astype(np.uint8).tobytes()
    return header + ids + masks


def decode_pair(record: bytes, dtype: np.dtype):
    """((chosen ids, mask), (rejected ids, mask)) of an `encode_pair` record."""
    le = np.dtype(dtype).newbyteorder("<")
    nc, nr = (int(x) for x in np.frombuffer(record, "<u4", count=2))
    ids = np.frombuffer(record, le, offset=8, count=nc + nr).astype(np.int32)
    masks = np.frombuffer(record, np.uint8, offset=8 + (nc + nr) * le.itemsize, count=nc + nr)
    return (ids[:nc], masks[:nc].copy()), (ids[nc:], masks[nc:].copy())
