"""huggingface accelerate (pinned, with only the packages its clip and prepare paths import; never torch).

transformers is there because accelerate's TP path needs it: ``ParallelismConfig(tp_size>1)`` checks
its version (``TorchTensorParallelConfig``: transformers >= 4.52) and FSDP2+TP ``prepare`` imports
``transformers.integrations.tensor_parallel.ReplicateParallel``. The Hugging Face stack is the one
shared with the other folders (``harness.scenarios.huggingface``: transformers 5.18.0, which VeOmni
and NeMo Automodel need); transformers 5 removed ``ReplicateParallel``, so with it accelerate's
FSDP2+TP ``prepare`` raises ImportError and the adapter refuses that layout (with transformers 4.57.6
it runs and is exact). Its import needs the hub client and ``regex``/``requests``, nothing else.
"""

from ..huggingface import HF_STACK
from harness.cases.frameworks import Framework

_RECIPE = (
    "pip install --no-deps accelerate==1.15.0",
    f"pip install --no-deps {HF_STACK}",
)


RELEASES = ("1.14.0", "1.15.0", "1.16.0")
"""The releases the adapter was run against, oldest first (torch 2.13 on CPU/gloo, worlds 2 and 4, fp32
and bf16, in a venv shadowing only accelerate; the pin is 1.15.0, 1.16.0 the newest):

* 1.14.0: ``tp mixed plain/DTensor`` (and its ``nan`` row) raises ``aten._foreach_norm.Scalar got mixed
  torch.Tensor and DTensor``: the crash accelerate PR #4219 fixed in 1.15.0 (no finding matches it
  but the Linf ``nan`` row's, torch's NaN finding, by pattern); ``tp experts plain`` raises the same
  way (under its finding's pattern); the FSDP2 layouts are as in 1.15.0;
* 1.15.0: ``_clip_grad_norm_dtensor_aware`` groups gradients by DTensor mesh plus one plain group;
* 1.16.0: the same function rewritten (groups keyed by mesh, ``None`` for plain, ``foreach``, no clip
  for ``max_norm=inf``), the plain group's norm still rank-local: the same verdicts and ratios as
  1.15.0 on every layout; FSDP2+TP ``prepare`` still imports ``ReplicateParallel``.

With transformers 4.57.6 instead of the pinned 5.18.0 (accelerate 1.15.0 and 1.16.0): the same, plus
``fsdp2+tp`` exact. Which transformers releases produce the plain-shard layouts (``tp experts plain``:
4.x; ``tp all plain``: 5.5 to 5.14; neither from 5.16) was checked with ``repro_tp_plain_experts.py``.
"""

FRAMEWORK = Framework(
    "accelerate", "accelerate.utils.fsdp_utils", "accelerate", " && ".join(_RECIPE), recipe=_RECIPE,
    releases=RELEASES)
