"""torchtitan (pinned, without its training-stack dependencies, which the adapter does not use)."""

from harness.targets.frameworks import Framework

FRAMEWORK = Framework(
    "torchtitan", "torchtitan.distributed.utils", "torchtitan",
    "pip install --no-deps torchtitan==0.3.0 && pip install spmd_types==0.2.3 tyro",
    recipe=("pip install --no-deps torchtitan==0.3.0", "pip install spmd_types==0.2.3 tyro"),
)
