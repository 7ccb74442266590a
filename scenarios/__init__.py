"""Built-in scenarios, one module each. ``SCENARIOS`` lists their classes in display order."""

from .deepspeed_autoep import DeepSpeedAutoEP
from .dense_dp import DenseDP
from .xorl_ep_lora import XorlEPLoRA

SCENARIOS = (XorlEPLoRA, DeepSpeedAutoEP, DenseDP)

__all__ = ["SCENARIOS", "DeepSpeedAutoEP", "DenseDP", "XorlEPLoRA"]
