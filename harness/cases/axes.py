"""The names of the mesh axes the built-in scenarios, mutants and adapters use, in one place.

A mesh *axis* is a named dimension of the device mesh (``MeshSpec``); a tensor's *dim* is one of its
own dimensions (``Shard(dim)``). The names follow the frameworks they model, so a scenario reads
like the framework's own configuration: torchtitan's ``dp_shard_cp`` / ``efsdp``, xorl's
``ep_fsdp``, DeepSpeed's ``edp``. Members are strings (``MeshAxis.EP == "ep"``), so a user's own
scenario may still name its axes freely; ``MeshSpec.of(ep=4)`` spells the same names as keywords.
"""

from __future__ import annotations

from enum import StrEnum


class MeshAxis(StrEnum):
    DP = "dp"
    """Plain data parallel: every rank of the axis holds a replica."""
    DP_REPLICATE = "dp_replicate"
    """The replicated half of HSDP (torchtitan's name)."""
    DP_SHARD = "dp_shard"
    """The sharded half of HSDP (torchtitan's name)."""
    DP_SHARD_CP = "dp_shard_cp"
    """torchtitan's flattened FSDP axis (data shard x context parallel)."""
    FSDP = "fsdp"
    """Fully sharded data parallel over the whole axis."""
    EP = "ep"
    """Expert parallel: each coordinate owns different experts."""
    EP_FSDP = "ep_fsdp"
    """FSDP of the expert parameters inside an EP group (xorl's name)."""
    EFSDP = "efsdp"
    """torchtitan's expert FSDP axis."""
    EDP = "edp"
    """DeepSpeed's expert data parallel group."""
    TP = "tp"
    """Tensor parallel."""
    PP = "pp"
    """Pipeline parallel: each coordinate is a stage holding its own parameters (a tied parameter,
    such as an embedding shared by the first and last stage, is present on both)."""
    CP = "cp"
    """Context parallel: ranks of the axis hold the same (all-reduced) gradients."""
