"""dataset_type=tfds: the text documents of a prepared TFDS dataset, read without TensorFlow.

Reads `dataset_name` (e.g. "my_corpus", "my_corpus/config:1.0.0") from `dataset_path` (the TFDS
data_dir; empty means TFDS's default, ~/tensorflow_datasets) through `tfds.data_source`-style
random access, which needs only `tensorflow-datasets` and `array_record`, not TensorFlow. Nothing
is ever downloaded or generated: the dataset must already be prepared in a random-access file
format (`array_record`, or `parquet`). Datasets stored as `tfrecord` (TFDS's default when
TensorFlow prepares them) are rejected with instructions, as reading them needs TensorFlow.

Each record's text feature becomes one document. The feature is the one named by
`text_feature`, else the only `Text` feature, else the one called "text". Training reads the
split `train_split` (MaxText's key, default "train"); the held-out split is `eval_split` (default
"validation") if the dataset has it, else the last `eval_split_fraction` of the training split
(as for dataset_type=text), which the run's data summary says. The documents then take the same
tokenize/cache/pack path as dataset_type=text, so the whole split is tokenized once; that suits
corpora up to a few GB of text, not C4-scale streaming.
"""

from __future__ import annotations

from MaxText.data.errors import DataImportError, DataNotFoundError
from MaxText.data.text import Document, split_tail

TFDS_PIN = "tensorflow-datasets==4.9.10"
_READ_CHUNK = 1024


def load_tfds_documents(
    dataset_name: str,
    data_dir: str,
    *,
    train_split: str,
    eval_split: str,
    eval_fraction: float,
    text_feature: str | None = None,
) -> tuple[list[Document], list[Document], str]:
    """(train documents, eval documents, a one-line description) of a prepared TFDS dataset."""
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        raise DataImportError(
            f"dataset_type=tfds needs the tensorflow-datasets package (pip install {TFDS_PIN}); "
            "TensorFlow itself is not needed"
        ) from None
    if not dataset_name:
        raise ValueError("dataset_type=tfds needs dataset_name= (the TFDS dataset to read)")
    where = f"data_dir {data_dir!r}" if data_dir else "the default TFDS data_dir"
    try:
        builder = tfds.builder(dataset_name, data_dir=data_dir or None)
    except tfds.core.registered.DatasetNotFoundError:
        raise DataNotFoundError(
            f"no prepared TFDS dataset {dataset_name!r} in {where} (dataset_path=); prepare it "
            "there first with file_format='array_record' (this trainer never downloads data)"
        ) from None
    if not builder.is_prepared():
        raise DataNotFoundError(
            f"TFDS dataset {dataset_name!r} is not prepared in {where} (dataset_path=); prepare "
            "it there first with file_format='array_record' (this trainer never downloads data)"
        )
    info = builder.info
    formats = {f.value for f in info.available_file_formats()}
    if not formats & {"array_record", "parquet"}:
        raise ValueError(
            f"TFDS dataset {dataset_name!r} in {where} is stored as {sorted(formats)}; reading "
            "it without TensorFlow needs a random-access format: prepare it again with "
            "download_and_prepare(file_format='array_record')"
        )
    feature = _text_feature(tfds, info.features, text_feature, dataset_name)
    splits = set(info.splits.keys())
    if train_split not in splits:
        raise DataNotFoundError(
            f"TFDS dataset {dataset_name!r} has no split train_split={train_split!r} (it has "
            f"{sorted(splits)})"
        )
    train = _read_split(builder, train_split, feature)
    if eval_split in splits and eval_split != train_split:
        held_out = eval_split
        evals = _read_split(builder, eval_split, feature)
    else:
        held_out = f"last {eval_fraction:g} of {train_split} (no split eval_split={eval_split!r})"
        train, evals = split_tail(train, eval_fraction)
    description = f"tfds {dataset_name} ({feature!r}; eval = {held_out}) from {where}"
    return train, evals, description


def _text_feature(tfds, features, requested: str | None, dataset_name: str) -> str:
    texts = sorted(k for k, f in features.items() if isinstance(f, tfds.features.Text))
    if requested:
        if requested not in texts:
            raise ValueError(
                f"TFDS dataset {dataset_name!r} has no text feature {requested!r}; its text "
                f"features are {texts}"
            )
        return requested
    if len(texts) == 1:
        return texts[0]
    if "text" in texts:
        return "text"
    raise ValueError(
        f"TFDS dataset {dataset_name!r} has text features {texts}; name the one to train on "
        "(make_data(config, tfds_text_feature=...))"
        if texts
        else f"TFDS dataset {dataset_name!r} has no Text feature (features: {sorted(features)})"
    )


def _read_split(builder, split: str, feature: str) -> list[Document]:
    source = builder.as_data_source(split=split)
    get_many = getattr(source, "__getitems__", None)
    docs = []
    for start in range(0, len(source), _READ_CHUNK):
        ids = list(range(start, min(start + _READ_CHUNK, len(source))))
        records = get_many(ids) if get_many else [source[i] for i in ids]
        for offset, record in enumerate(records):
            value = record[feature]
            text = value.decode("utf-8") if isinstance(value, bytes) else str(value)
            if text:
                docs.append(Document(name=f"{split}/{start + offset}", text=text))
    return docs
