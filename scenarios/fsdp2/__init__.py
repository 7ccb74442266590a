"""torch's FSDP2 on 1-D and 2-D meshes: the scenario (its layouts), the adapter (the framework's own clip, set up the way the
framework sets a model up), in one folder."""

from .adapter import TARGETS
FRAMEWORK = None  # torch itself
from .scenario import FSDP2Meshes as SCENARIO

__all__ = ["FRAMEWORK", "SCENARIO", "TARGETS"]
