"""Adapters: the clip functions of real frameworks, called on the harness's model after it has been
set up the way each framework would set it up. Nothing of the frameworks' code is copied; a missing
framework turns its cases into skips with the install hint as the reason."""

from __future__ import annotations

from ..targets import Target
from . import deepspeed, fsdp2, megatron, torchtitan, xorl

ADAPTER_TARGETS: dict[str, Target] = {
    t.name: t for module in (deepspeed, torchtitan, megatron, xorl, fsdp2) for t in module.TARGETS
}
