"""The run configuration: pydantic models (`configs.models`), Eq. 20's recompute block (`configs.recompute_block`)
and the YAML presets next to them. Low in the house: the runtime, the cost model, benchmarks and the app import
it; it imports `kernels.config` and `schedules.build` (a schedule's own M/P rules validate a config), never them."""
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
    config_stage_blocks,
    presets,
    stage_blocks,
)
from .recompute_block import eq20_block_size, eq20_objective, recompute_block_size  # noqa: F401
from kernels import residual_spec  # noqa: F401 - the residual variants' one home, for the cost model above configs
