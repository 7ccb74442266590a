"""Built-in scenarios: one folder per real framework (its scenario, adapter and install recipe), and
the torch-only layouts ``dense_dp``, ``dense_edges``, ``pipeline_stages`` and ``hsdp_cp``. Each member has ``SCENARIO``, ``TARGETS`` and ``FRAMEWORK``; registering
one is one entry in ``MEMBERS`` (display order)."""

from . import (accelerate, automodel, colossalai, deepspeed, dense_dp, dense_edges, fsdp2, hsdp_cp, megatron,
               pipeline_stages, torchtitan, torchtune, veomni, xorl)

MEMBERS = (xorl, deepspeed, dense_dp, dense_edges, torchtitan, megatron, fsdp2, pipeline_stages, hsdp_cp, accelerate,
           torchtune, veomni, colossalai, automodel)

SCENARIOS = tuple(member.SCENARIO for member in MEMBERS)
ADAPTER_TARGETS = tuple(target for member in MEMBERS for target in member.TARGETS)
FRAMEWORKS = tuple(member.FRAMEWORK for member in MEMBERS if member.FRAMEWORK is not None)

__all__ = ["ADAPTER_TARGETS", "FRAMEWORKS", "MEMBERS", "SCENARIOS"]
