"""xorl: not on the package index (the PyPI 'xorl' is another project), so no recipe CI can run."""

from harness.targets.frameworks import Framework

FRAMEWORK = Framework(
    "xorl", "xorl.distributed.fsdp2.clip_grad_norm", None,
    "it is not on the package index (the PyPI 'xorl' is another project): git clone "
    "https://github.com/togethercomputer/xorl, pip install einops triton==3.6.0 transformers torchdata psutil, "
    "and put its src/ on PYTHONPATH",
)
