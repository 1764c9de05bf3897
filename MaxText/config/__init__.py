"""The trainer's configuration: `load_config(argv) -> Config` (frozen, validated once).

- `loader.py`: the `Config` fields with their constraints, loading (YAML layers + `key=value`),
  `Config.replace` and `Config.resolve_devices`;
- `rules.py`: the rules between keys and the derived values; `mesh.py`: the parallelism axes and
  MaxText's -1 fill; `pipeline.py`: schedule, stages, layers and remat per stage, microbatches;
- `maxtext_compat.py`: MaxText's key names and values; `unsupported_keys.py`: MaxText keys and
  values this trainer refuses, each with its reason.
"""

from MaxText.config.loader import (  # noqa: F401  (the package's public names)
    ALIASES,
    ATTENTION_KERNELS,
    CHOICES,
    CONFIGS_DIR,
    DATASET_TYPES,
    DECODER_BLOCKS,
    Config,
    ConfigError,
    derived_fields,
    key_fields,
    load_config,
    stage_layer_counts,
)
