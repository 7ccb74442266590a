"""ColossalAI's MoE hybrid-parallel ZeRO optimizer: the scenario (its layouts), the adapter (the
framework's own optimizer step, set up the way its plugin sets a model up), and the pinned install
recipe, in one folder."""

from .adapter import TARGETS
from .framework import FRAMEWORK
from .scenario import ColossalAIMoE as SCENARIO

__all__ = ["FRAMEWORK", "SCENARIO", "TARGETS"]
