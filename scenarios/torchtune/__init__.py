"""torchtune 0.6.1's distributed full-finetune recipe: the scenario (its FSDP2 and tensor-parallel
layouts), the adapter (torchtune's own model builder, TP plan and ``shard_model``, then the recipe's
clip step), and the pinned install recipe, in one folder."""

from .adapter import TARGETS
from .framework import FRAMEWORK
from .scenario import TorchtuneTP as SCENARIO

__all__ = ["FRAMEWORK", "SCENARIO", "TARGETS"]
