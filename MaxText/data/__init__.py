"""The trainer's data pipeline; `make_data(config)` (in `loader.py`) builds train/eval batches and
the tokenizer. See `loader.py` for the pipelines and their modules."""

from MaxText.data.loader import (  # noqa: F401  (the package's public names)
    DATASET_TYPES,
    Data,
    DataInfo,
    Tokenizer,
    make_data,
    unigram_entropy_nats,
)
