"""huggingface accelerate's ``Accelerator.clip_grad_norm_`` on FSDP2, HSDP and TP (DTensor) models: the
scenario (its layouts), the adapter (accelerate's own setup and clip) and the pinned install recipe."""

from .adapter import TARGETS
from .framework import FRAMEWORK
from .scenario import AccelerateParallelism as SCENARIO

__all__ = ["FRAMEWORK", "SCENARIO", "TARGETS"]
