"""The run configuration: pydantic models (`configs.models`) and the YAML presets next to them. Low in the house:
runtime, cost model, benchmarks and the app all import it; it imports only `kernels.config`."""
from .models import (  # noqa: F401
    CONFIG_DIR,
    MoEConfig,
    ModelConfig,
    ParallelConfig,
    RecomputeConfig,
    RunConfig,
    ScheduleKind,
    TrainConfig,
    load_config,
    load_config_data,
    parse_config,
    presets,
    stage_blocks,
)
