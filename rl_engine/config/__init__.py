"""Configuration: one pydantic model per component, composed into the root `RFTConfig`.

A YAML file loads into `RFTConfig` (`load_config(path, overrides)`), `--set a.b=c` overrides
apply before validation, and `cfg.resolved()` fills the derived values (run name, train batch
size, tokenizer path) in one explicit step; `rl_engine.run.context.start_run` writes the resolved
config to the run directory. Validators only check; the one rewrite is `migrate` (an older
version's shape into today's), which `RFTConfig` applies before checking, so that a Prefect
deployment registered with an older `cfg` keeps running.

Field paths are part of the interface (`synchronizer.sync_interval`, ...): they appear in error
messages, in `--set` overrides and in the Prefect UI form of every flow.

One module per component (model.py: model and task set, algorithm.py, explorer.py, buffer.py,
trainer.py, synchronizer.py: a union on `mode`, placement.py, workflow.py: episodes and user code, evaluation.py: held-out evaluation), root.py composes them into
`RFTConfig`, unions.py finds the config's unions (a section whose variant `type` or `mode` selects; what
`--set` switches), loading.py reads files, applies overrides and formats errors, migrate.py rewrites an older version's
shape before validation (so old files and runs' stored configs keep loading), advice.py holds the
warnings `rft validate` prints. Every name is importable from `rl_engine.config`. Nothing here
touches the filesystem while validating: rl_engine/run/preflight.py checks the model directory.

    python -m rl_engine.config configs/demo.yaml      # validate and print the resolved config
"""

from rl_engine.config.advice import config_warnings, step_volume
from rl_engine.config.algorithm import AlgorithmConfig, KLConfig
from rl_engine.config.base import ConfigError, _Model
from rl_engine.config.buffer import BufferConfig, StorageConfig
from rl_engine.config.evaluation import EvalConfig, EvalTasksetConfig, KeepBestConfig
from rl_engine.config.explorer import EngineConfig, ExplorerConfig, PartialRolloutConfig, SamplingConfig
from rl_engine.config.loading import (
    apply_overrides,
    load_config,
    migrate_file,
    parse_override,
    parse_yaml,
    read_yaml,
    to_yaml,
    validate_config,
)
from rl_engine.config.migrate import migrate
from rl_engine.config.model import (
    ArithmeticReward,
    CodeTestsReward,
    CountdownReward,
    FinalAnswerReward,
    JudgeReward,
    LoRAConfig,
    ModelConfig,
    ModelReward,
    PythonReward,
    RegisteredReward,
    RewardConfig,
    SandboxConfig,
    TasksetConfig,
)
from rl_engine.config.placement import DeploymentsPlacement, DeviceSplit, LocalPlacement, PlacementConfig
from rl_engine.config.root import (
    MAX_SEED,
    LineageConfig,
    MLflowTracker,
    MonitorConfig,
    RFTConfig,
    TensorBoardTracker,
    TrackerConfig,
    WandbTracker,
)
from rl_engine.config.synchronizer import (
    DECOUPLED_MODES,
    RENDEZVOUS_MODES,
    CollectiveConfig,
    DecoupledSync,
    DeltaConfig,
    Mode,
    RendezvousSync,
    SynchronizerConfig,
)
from rl_engine.config.trainer import TrainerConfig
from rl_engine.config.workflow import (
    CalculatorWorkflow,
    GuessNumberWorkflow,
    PythonWorkflow,
    RegisteredWorkflow,
    SingleTurnWorkflow,
    UserCodeConfig,
    WorkflowConfig,
)

__all__ = [
    "DECOUPLED_MODES",
    "MAX_SEED",
    "RENDEZVOUS_MODES",
    "AlgorithmConfig",
    "ArithmeticReward",
    "BufferConfig",
    "CalculatorWorkflow",
    "CodeTestsReward",
    "CollectiveConfig",
    "ConfigError",
    "CountdownReward",
    "DecoupledSync",
    "DeltaConfig",
    "DeploymentsPlacement",
    "DeviceSplit",
    "EngineConfig",
    "EvalConfig",
    "EvalTasksetConfig",
    "ExplorerConfig",
    "FinalAnswerReward",
    "GuessNumberWorkflow",
    "JudgeReward",
    "KLConfig",
    "KeepBestConfig",
    "LineageConfig",
    "LoRAConfig",
    "LocalPlacement",
    "MLflowTracker",
    "Mode",
    "ModelConfig",
    "ModelReward",
    "MonitorConfig",
    "PartialRolloutConfig",
    "PlacementConfig",
    "PythonReward",
    "PythonWorkflow",
    "RFTConfig",
    "RegisteredReward",
    "RegisteredWorkflow",
    "RendezvousSync",
    "RewardConfig",
    "SamplingConfig",
    "SandboxConfig",
    "SingleTurnWorkflow",
    "StorageConfig",
    "SynchronizerConfig",
    "TasksetConfig",
    "TensorBoardTracker",
    "TrackerConfig",
    "TrainerConfig",
    "UserCodeConfig",
    "WandbTracker",
    "WorkflowConfig",
    "_Model",
    "apply_overrides",
    "config_warnings",
    "load_config",
    "migrate",
    "migrate_file",
    "parse_override",
    "parse_yaml",
    "read_yaml",
    "step_volume",
    "to_yaml",
    "validate_config",
]
