"""Weight sync from the trainer to the explorers' live engines: `collective` and `checkpoint`.

Entry points (factory.py): `build_weight_sender(cfg)`, `build_weight_receiver(cfg, explorer_id)`.
"""

from rl_engine.api import WeightReceiver, WeightSender
from rl_engine.sync.factory import build_weight_receiver, build_weight_sender, drop_versions_from

__all__ = ["WeightReceiver", "WeightSender", "build_weight_receiver", "build_weight_sender", "drop_versions_from"]
