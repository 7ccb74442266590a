"""VeOmni (pinned, without its training-stack dependencies). Importing any ``veomni`` module runs the
package ``__init__`` (ops patches), which imports transformers 5; the Hugging Face stack of
``harness.scenarios.huggingface`` (transformers 5.18) imports and runs it next to torch 2.13 CPU
(VeOmni 0.1.12's generated model code says "based on transformers==5.9.0"; 5.18 passes the same tests)."""

from ..huggingface import HF_STACK
from harness.targets.frameworks import Framework

_DEPS = HF_STACK

FRAMEWORK = Framework(
    "veomni", "veomni.distributed.fsdp2.clip_grad_norm", "veomni",
    f"pip install --no-deps veomni==0.1.12 && pip install --no-deps {_DEPS}",
    recipe=("pip install --no-deps veomni==0.1.12", f"pip install --no-deps {_DEPS}"),
)
