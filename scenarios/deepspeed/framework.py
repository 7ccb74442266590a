"""DeepSpeed (pinned CPU build: its ops not built, its sdist built against the installed torch)."""

from harness.targets.frameworks import Framework

FRAMEWORK = Framework(
    "deepspeed", "deepspeed.runtime.utils", "deepspeed",
    "pip install 'clipcheck[deepspeed]' (CPU: DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8)",
    recipe=("DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8",),
)
