"""huggingface accelerate (pinned, with only the packages its clip and prepare paths import; never torch).

transformers is there because accelerate's TP path needs it: ``ParallelismConfig(tp_size>1)`` checks
its version (``TorchTensorParallelConfig``: transformers >= 4.52) and FSDP2+TP ``prepare`` imports
``transformers.integrations.tensor_parallel.ReplicateParallel``, which transformers 5 removed (with
transformers 5.25.0 that ``prepare`` raises ImportError), hence the 4.57 line; its import needs the
hub client and ``regex``/``requests``, nothing else (no tokenizers).
"""

from ..huggingface import HF_STACK
from harness.targets.frameworks import Framework

_RECIPE = (
    "pip install --no-deps accelerate==1.15.0",
    f"pip install --no-deps {HF_STACK}",
)

FRAMEWORK = Framework(
    "accelerate", "accelerate.utils.fsdp_utils", "accelerate", " && ".join(_RECIPE), recipe=_RECIPE,
)
