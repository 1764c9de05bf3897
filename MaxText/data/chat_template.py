"""Chat templates: finding a checkpoint's Jinja template and rendering it as transformers does.

`ChatTemplate.render(messages, add_generation_prompt)` gives the string Hugging Face transformers'
`apply_chat_template(..., tokenize=False)` gives (checked against transformers 4.47.1 in
tests/test_chat_template.py): the template runs in a sandboxed (immutable) Jinja environment with
`trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension and a `{% generation %}` block tag
(rendered as its body), the `tojson` filter as `json.dumps` (no HTML escaping; `indent`,
`separators`, `sort_keys`, `ensure_ascii`), and the globals `raise_exception(message)` and
`strftime_now(format)`. The variables are `messages`, `add_generation_prompt`, the tokenizer's
special tokens (`bos_token`, `eos_token`, `unk_token`, `pad_token`, ... as strings) and
`tools`/`documents` (None).

`strftime_now` formats a FIXED date (`ChatTemplate.date`, default: the day `prepare` ran), recorded
in the prepared data's manifest, so the same data prepares to the same tokens on any day (Llama
3's template writes "Today Date: ..." into every system header).

`find_chat_template(folder, fallback)` picks the template of a tokenizer folder (a converted
checkpoint's, a Hugging Face model's): `chat_template.jinja` beside the tokenizer, else the
`chat_template` of `tokenizer_config.json` (a string, or the entry named "default" of a list);
without either, the named fallback (`FALLBACKS`: the published templates committed under
`chat_templates/`, see its SOURCES.md), or a `.jinja` file; else a `DataError` naming the folder.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from MaxText.data.errors import DataError

TEMPLATES_DIR = pathlib.Path(__file__).resolve().parent / "chat_templates"
FALLBACKS = ("chatml", "llama3", "mistral", "gemma")
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
# transformers passes the special tokens its tokenizer has set (`special_tokens_map`)
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class TemplateError(ValueError):
    """The template failed to render (its own `raise_exception`, or a Jinja error)."""


def _environment():
    """The sandboxed Jinja environment of transformers' chat templates (see the module doc)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: marks the assistant's text (transformers
        tracks it for `return_assistant_tokens_mask`); renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTag, jinja2.ext.loopcontrols],
    )

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


@dataclasses.dataclass
class ChatTemplate:
    """A chat template and what it is rendered with. `origin` says where it came from."""

    source: str
    origin: str
    special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)
    date: datetime.date = dataclasses.field(default_factory=datetime.date.today)
    _compiled: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.source.encode("utf-8")).hexdigest()

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        """The conversation as the template writes it; TemplateError when it fails."""
        import jinja2

        if self._compiled is None:
            env = _environment()
            date = self.date

            def strftime_now(fmt):
                return datetime.datetime.combine(date, datetime.time()).strftime(fmt)

            env.globals["strftime_now"] = strftime_now
            try:
                self._compiled = env.from_string(self.source)
            except jinja2.exceptions.TemplateSyntaxError as e:
                raise TemplateError(f"line {e.lineno}: {e.message}") from None
        try:
            return self._compiled.render(
                messages=[dict(m) for m in messages],
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.exceptions.TemplateError as e:
            raise TemplateError(str(e) or type(e).__name__) from None
        except (TypeError, KeyError, IndexError, AttributeError) as e:
            raise TemplateError(f"{type(e).__name__}: {e}") from None


def _token_text(value: Any) -> str | None:
    value = value.get("content") if isinstance(value, Mapping) else value
    return value if isinstance(value, str) else None


def read_tokenizer_config(folder: pathlib.Path) -> dict[str, Any]:
    """The folder's tokenizer_config.json as a dict ({} when absent); DataError if unreadable."""
    path = folder / TOKENIZER_CONFIG
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise DataError(f"{path} is not a JSON object")
    return raw


def special_tokens(folder: pathlib.Path, tokenizer: Any) -> dict[str, str]:
    """The special-token strings the template sees: tokenizer_config.json's, else the pieces of
    the tokenizer's BOS/EOS ids."""
    config = read_tokenizer_config(folder)
    out = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k))) is not None}
    for key, token_id in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id)):
        if key not in out and token_id >= 0:
            out[key] = tokenizer.id_to_piece(token_id)
    return out


def _from_config(config: Mapping[str, Any], where: pathlib.Path) -> str | None:
    template = config.get("chat_template")
    if template is None:
        return None
    if isinstance(template, str):
        return template
    if isinstance(
        template, list
    ):  # [{"name": "default", "template": ...}, {"name": "tool_use"...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise DataError(f"{where}: chat_template is neither a string nor a list with a 'default' entry")


def find_chat_template(
    folder: pathlib.Path, fallback: str, tokenizer: Any, date: datetime.date | None = None
) -> ChatTemplate:
    """The template for a tokenizer in `folder` (see the module doc for the order)."""
    tokens = special_tokens(folder, tokenizer)
    date = date or datetime.date.today()
    jinja_file = folder / TEMPLATE_FILE
    if jinja_file.is_file():
        source = jinja_file.read_text(encoding="utf-8")
        return ChatTemplate(source, f"file {jinja_file}", tokens, date)
    source = _from_config(read_tokenizer_config(folder), folder / TOKENIZER_CONFIG)
    if source is not None:
        return ChatTemplate(source, f"{folder / TOKENIZER_CONFIG}", tokens, date)
    if fallback:
        return ChatTemplate(fallback_source(fallback), f"fallback {fallback}", tokens, date)
    raise DataError(
        f"the tokenizer in {folder} has no chat_template (no {TEMPLATE_FILE}, none in "
        f"{TOKENIZER_CONFIG}); name a fallback, {'|'.join(FALLBACKS)} or a .jinja file "
        "(prepare --chat_template, or chat_template= for train.py and generate)"
    )


def fallback_source(name: str) -> str:
    """The Jinja source of fallback `name` (one of FALLBACKS) or of a .jinja file."""
    if name in FALLBACKS:
        return (TEMPLATES_DIR / f"{name}.jinja").read_text(encoding="utf-8")
    path = pathlib.Path(name).expanduser()
    if path.suffix == ".jinja" and path.is_file():
        return path.read_text(encoding="utf-8")
    raise DataError(
        f"chat_template={name!r} is neither one of {', '.join(FALLBACKS)} nor a .jinja file"
    )
