"""NeMo Automodel MoE (EP + FSDP2): the scenario (its layouts), the adapter (Automodel's own clip, on a
model set up with Automodel's meshes, ExpertParallel and FSDP2 wrapping), and the pinned install
recipe, in one folder."""

from .adapter import TARGETS
from .framework import FRAMEWORK
from .scenario import AutomodelEP as SCENARIO

__all__ = ["FRAMEWORK", "SCENARIO", "TARGETS"]
