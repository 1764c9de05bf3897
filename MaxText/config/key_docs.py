"""Each config key's documentation, read from where it is declared: one `KeyDoc` per key.

- group, default and doc come from `configs/base.yml`: the group is the title of the
  `# ---- <title>` line above the key, the default is the value as written, the doc is the
  key's trailing comment plus any comment lines indented below it;
- type and range come from the key's field of `Config` (`loader.py`): its type, `choices`,
  bounds, and what -1 or `auto` mean there;
- `presets`: the presets of `configs/models/` that set the key (`model_name=tiny`, the default,
  sets the model's shape), with the value the default preset gives it.

`key_docs()` fails with `KeyDocError` naming the key when base.yml and `Config` disagree (a key
in one but not the other) or a key has no doc. The config reference page
(`MaxText.config.reference`) and every tool's `--help` (`MaxText.config.tool_help`) read it.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from MaxText.config.loader import ALIASES, CONFIGS_DIR, KEYS, STRINGS, TYPES

BASE_YML = CONFIGS_DIR / "base.yml"
DEFAULT_PRESET = "tiny"  # base.yml's model_name (checked in key_docs)
_GROUP = re.compile(r"^# -{4,}\s*(?P<title>.+?)\s*$")
_KEY = re.compile(r"^(?P<name>[a-z_][a-z0-9_]*):(?P<rest>.*)$")
_MORE = re.compile(r"^\s+#\s?(?P<text>.*)$")


class KeyDocError(ValueError):
    """base.yml and the declared keys disagree, or a key has no doc."""


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    name: str
    group: str  # the `# ----` title above it in base.yml
    type: str  # int | float | bool | str | list of str
    default: str  # as written in base.yml
    range: str  # "" when any value of the type goes
    doc: str
    presets: tuple[str, ...]  # presets (configs/models/*.yml) that set it
    preset_default: str | None  # the default preset's value, when it sets the key

    def matches(self, word: str) -> bool:
        """The word (any case) is in the key's name or its doc."""
        word = word.lower()
        return word in self.name.lower() or word in self.doc.lower()


def _split_comment(rest: str) -> tuple[str, str]:
    """`value   # comment` -> (value, comment); a `#` inside quotes is part of the value."""
    quote = None
    for i, ch in enumerate(rest):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "#" and (i == 0 or rest[i - 1].isspace()):
            return rest[:i].strip(), rest[i + 1 :].strip()
    return rest.strip(), ""


def parse_base_yml(text: str) -> tuple[list[dict[str, str]], dict[str, str]]:
    """base.yml's keys in order, each {name, group, default, doc}; and each group's note (comment
    lines at the top of a group, before its first key)."""
    keys: list[dict[str, str]] = []
    notes: dict[str, str] = {}
    group, last = "", None
    for line in text.splitlines():
        if m := _GROUP.match(line):
            group, last = m["title"], None
            notes[group] = ""
        elif (m := _KEY.match(line)) and group:
            default, doc = _split_comment(m["rest"])
            last = {"name": m["name"], "group": group, "default": default, "doc": doc}
            keys.append(last)
        elif (m := _MORE.match(line)) and last is not None:
            last["doc"] = f"{last['doc']} {m['text'].strip()}".strip()
        elif line.startswith("#") and group and last is None:
            notes[group] = f"{notes[group]} {line.lstrip('#').strip()}".strip()
        elif not line.strip():
            continue
        else:
            last = None
    return keys, notes


def describe_range(metadata: Mapping[str, Any]) -> str:
    """A field's constraints in words: `a | b`, `>= 1`, `-1: the rest`, `auto: ...`."""
    parts = []
    if metadata.get("choices") is not None:
        parts.append(" | ".join(c if c != "" else '""' for c in metadata["choices"]))
    bounds = [
        f"{op} {metadata[k]}"
        for k, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
        if metadata.get(k) is not None
    ]
    if bounds:
        parts.append(", ".join(bounds))
    if metadata.get("minus_one"):
        parts.append(f"-1: {metadata['minus_one'].strip(chr(39))}")
    if metadata.get("auto"):
        parts.append("auto: decided by the planner")
    return "; ".join(parts)


def _presets(models_dir: Path) -> dict[str, dict[str, Any]]:
    """{preset name: {key: value as written}} for every configs/models/*.yml."""
    out = {}
    for path in sorted(models_dir.glob("*.yml")):
        raw = yaml.safe_load(path.read_text()) or {}
        out[path.stem] = {ALIASES.get(k, k): v for k, v in raw.items() if k != "base_config"}
    return out


def _as_yaml(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


@functools.cache
def key_docs() -> tuple[KeyDoc, ...]:
    """Every key in base.yml's order (see the module docstring)."""
    keys, _ = parse_base_yml(BASE_YML.read_text())
    seen = [k["name"] for k in keys]
    missing = [name for name in KEYS if name not in seen]
    if missing:
        raise KeyDocError(f"{', '.join(missing)}: declared in Config but not in {BASE_YML}")
    undeclared = [name for name in seen if name not in KEYS]
    if undeclared:
        raise KeyDocError(f"{', '.join(undeclared)}: in {BASE_YML} but not declared in Config")
    no_doc = [k["name"] for k in keys if not k["doc"]]
    if no_doc:
        raise KeyDocError(
            f"{', '.join(no_doc)}: no doc; write one as the key's comment in {BASE_YML}"
        )
    presets = _presets(CONFIGS_DIR / "models")
    base_model = next(k["default"] for k in keys if k["name"] == "model_name")
    if base_model != DEFAULT_PRESET:
        raise KeyDocError(f"base.yml's model_name is {base_model}; update DEFAULT_PRESET")
    docs = []
    for k in keys:
        name = k["name"]
        by = tuple(p for p, values in presets.items() if name in values)
        default_preset = presets.get(DEFAULT_PRESET, {})
        docs.append(
            KeyDoc(
                name=name,
                group=k["group"],
                type="list of str" if TYPES[name] == STRINGS else TYPES[name].__name__,
                default=k["default"],
                range=describe_range(KEYS[name].metadata),
                doc=k["doc"],
                presets=by,
                preset_default=_as_yaml(default_preset[name]) if name in default_preset else None,
            )
        )
    return tuple(docs)


def group_notes() -> dict[str, str]:
    """Each group's note in base.yml (comment lines before its first key), by group title."""
    return parse_base_yml(BASE_YML.read_text())[1]


def all_presets() -> tuple[str, ...]:
    return tuple(_presets(CONFIGS_DIR / "models"))


def group_id(title: str) -> str:
    """A group's short name: its title before any parenthesis, lower case
    (`optimizer (AdamW)` -> `optimizer`)."""
    return title.split("(")[0].strip().lower()
