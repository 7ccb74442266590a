"""VeOmni (pinned, without its training-stack dependencies). Importing any ``veomni`` module runs the
package ``__init__`` (ops patches), which imports transformers 5; the Hugging Face stack of
``harness.scenarios.huggingface`` (transformers 5.18) imports and runs it next to torch 2.13 CPU
(VeOmni 0.1.12's generated model code says "based on transformers==5.9.0"; 5.18 passes the same tests).

VeOmni 0.1.12 is the newest release on the index. Checked against newer transformers (each in a scratch
venv over this one): 5.19.0, 5.20.2, 5.21.1 and 5.22.2 import, and ``veomni_ep`` at world 4 on 5.22.2
gives the same verdicts and ratios as on 5.18.0; from **5.23.0** on (5.23.0, 5.24.0, 5.25.0) importing any
``veomni`` module fails: ``ImportError: cannot import name 'Qwen2_5OmniThinkerCausalLMOutputWithPast'
from 'transformers.models.qwen2_5_omni.modeling_qwen2_5_omni'`` (raised at
``veomni/utils/model_outputs.py:39``, reached from the package ``__init__`` through
``veomni.ops.kernels.cross_entropy``; transformers 5.23 no longer defines that class). So VeOmni 0.1.12
needs transformers <= 5.22.x: the shared ``HF_STACK`` pin (5.18.0) satisfies it, and if that pin moves
to 5.23 or later this recipe must pin its own transformers (5.22.2 at most) instead of ``HF_STACK``'s."""

from ..huggingface import HF_STACK
from harness.cases.frameworks import Framework

_DEPS = HF_STACK

RELEASES = ("0.1.12",)
"""The newest release on the index is the pin; no other one was run."""

FRAMEWORK = Framework(
    "veomni", "veomni.distributed.fsdp2.clip_grad_norm", "veomni",
    f"pip install --no-deps veomni==0.1.12 && pip install --no-deps {_DEPS}",
    recipe=("pip install --no-deps veomni==0.1.12", f"pip install --no-deps {_DEPS}"),
    releases=RELEASES)
