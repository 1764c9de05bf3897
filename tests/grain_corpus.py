"""A small prepared grain corpus for end-to-end trainer tests: 300 JSONL documents of 1-30 words
drawn from a 15-word vocabulary, prepared into ArrayRecord shards (`MaxText.data.prepare`)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from MaxText.data import prepare as prepare_lib

WORDS = "thou art the fairest rose in all of verona and yet my lord doth speak".split()


def prepare_shards(base: Path, seed: int) -> Path:
    """Writes the corpus under `base/corpus` and its shards under `base/shards` (returned)."""
    rng = random.Random(seed)
    (base / "corpus").mkdir()
    with (base / "corpus" / "docs.jsonl").open("w") as f:
        for _ in range(300):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
            f.write(json.dumps({"text": text}) + "\n")
    prepare_lib.prepare(str(base / "corpus"), str(base / "shards"), vocab_size=320, quiet=True)
    return base / "shards"
