"""The model families by `decoder_block` value: the one place that lists them.

A new family is a file declaring `FAMILY` (`MaxText/model/family.py`) and a line here; the
config's `decoder_block` choices (`MaxText/config/loader.py`) must name the same families
(tests/test_families.py checks).
"""

from __future__ import annotations

from MaxText.model import gemma2, gpt, llama, mistral, qwen2, qwen3
from MaxText.model.family import Family

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, gemma2.FAMILY, gpt.FAMILY)
}


def family_of(config_or_name) -> Family:
    """The `Family` of a config (its `decoder_block`) or of a `decoder_block` value."""
    name = config_or_name if isinstance(config_or_name, str) else config_or_name.decoder_block
    return FAMILIES[name]


def family_for_architecture(architecture: str) -> Family | None:
    """The family whose Hugging Face format has this `architectures` entry, or None."""
    for family in FAMILIES.values():
        if family.hf is not None and family.hf.architecture == architecture:
            return family
    return None


def hf_architectures() -> list[str]:
    """The `architectures` values that convert, in registry order."""
    return [f.hf.architecture for f in FAMILIES.values() if f.hf is not None]
