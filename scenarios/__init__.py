"""Built-in scenarios, one module each. ``SCENARIOS`` lists their classes in display order."""

from .deepspeed_autoep import DeepSpeedAutoEP
from .dense_dp import DenseDP
from .fsdp2_meshes import FSDP2Meshes
from .megatron_moe_tp import MegatronMoETP
from .torchtitan_ep import TorchtitanEP
from .xorl_ep_lora import XorlEPLoRA

SCENARIOS = (XorlEPLoRA, DeepSpeedAutoEP, DenseDP, TorchtitanEP, MegatronMoETP, FSDP2Meshes)

__all__ = ["SCENARIOS", "DeepSpeedAutoEP", "DenseDP", "FSDP2Meshes", "MegatronMoETP", "TorchtitanEP", "XorlEPLoRA"]
