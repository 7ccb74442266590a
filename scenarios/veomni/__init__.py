"""VeOmni EP + FSDP2 (+ HSDP, + shared MoE LoRA): the scenario (its layouts), the adapter (VeOmni's own
clip, on a model VeOmni itself parallelized), and the pinned install recipe, in one folder."""

from .adapter import TARGETS
from .framework import FRAMEWORK
from .scenario import VeomniEP as SCENARIO

__all__ = ["FRAMEWORK", "SCENARIO", "TARGETS"]
