"""The trainer's configuration: `load_config(argv) -> Config` (frozen, validated once).

- `loader.py`: the `Config` fields, YAML + `key=value` merging, type checks, derived values;
- `checks.py`: data, attention and profiler keys; `mesh.py`: the parallelism axes and MaxText's
  -1 fill; `pipeline.py`: schedule, stages, layers and remat per stage, microbatches;
- `maxtext_compat.py`: MaxText's key names and values; `unsupported_keys.py`: MaxText keys this
  trainer refuses, each with its reason.
"""

from MaxText.config.loader import (  # noqa: F401  (the package's public names)
    ATTENTION_KERNELS,
    AUTO_KEYS,
    CHOICES,
    CONFIGS_DIR,
    PIPELINE_SCHEDULES,
    Config,
    ConfigError,
    derived_fields,
    key_fields,
    load_config,
    stage_layer_counts,
)
