"""xorl EP + LoRA: the scenario (its layouts), the adapter (the framework's own clip, set up the way the
framework sets a model up), and the pinned install recipe, in one folder."""

from .adapter import TARGETS
from .framework import FRAMEWORK
from .scenario import XorlEPLoRA as SCENARIO

__all__ = ["FRAMEWORK", "SCENARIO", "TARGETS"]
