"""megatron-core (pinned, without its training-stack dependencies)."""

from harness.targets.frameworks import Framework

FRAMEWORK = Framework(
    "megatron-core", "megatron.core.optimizer.clip_grads", "megatron-core",
    "pip install --no-deps megatron-core==0.16.1",
    recipe=("pip install --no-deps megatron-core==0.16.1",),
)
