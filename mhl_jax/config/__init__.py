"""Typed configuration: one dataclass per concern (`schema`), YAML files and `--set a.b=value` overrides (`load`),
cross-field checks (`validate`).

`load_config` reads a YAML file, applies overrides, checks types and cross-field consistency, and raises `ConfigError`
naming the offending key and value. Every field's comment in `schema` is the one place a key is documented
(docs/config.md is generated from them).
"""

from mhl_jax.config.load import (
    CONFIG_DIR,
    config_to_dict,
    dump_config,
    find_config,
    load_config,
    parse_override,
    saved_config,
    scale_schedule,
)
from mhl_jax.config.schema import (
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    FFNConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    ScheduleConfig,
    TrainConfig,
)
from mhl_jax.config.validate import validate

__all__ = ["CONFIG_DIR", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "FFNConfig", "LoggingConfig",
           "ModelConfig", "OptimizerConfig", "ParallelConfig", "ScheduleConfig", "TrainConfig", "config_to_dict",
           "dump_config", "find_config", "load_config", "parse_override", "saved_config", "scale_schedule", "validate"]
