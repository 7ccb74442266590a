"""ColossalAI (pinned sdist, its CUDA kernels not built: ``BUILD_EXT`` defaults to 0) and the few
packages its ``colossalai.zero.low_level`` / ``colossalai.booster.plugin`` imports need, each with
``--no-deps`` so that none of them replaces torch. ``colossalai.interface.model`` imports peft, which
imports transformers (and transformers checks its own dependency versions at import);
``colossalai.nn.optimizer`` imports galore_torch and bitsandbytes; the rest are what those need."""

from ..huggingface import HF_STACK
from harness.cases.frameworks import Framework

_DEPS = "einops==0.8.2 peft==0.13.2 accelerate==1.15.0 galore_torch==1.0 bitsandbytes==0.50.2 " + HF_STACK

RELEASES = ("0.5.0",)
"""The newest release on the index is the pin; no other one was run."""

FRAMEWORK = Framework(
    "colossalai", "colossalai.booster.plugin.moe_hybrid_parallel_plugin", "colossalai",
    "pip install --no-deps --no-build-isolation colossalai==0.5.0 && pip install --no-deps " + _DEPS,
    recipe=("pip install --no-deps --no-build-isolation colossalai==0.5.0", "pip install --no-deps " + _DEPS),
    releases=RELEASES)
