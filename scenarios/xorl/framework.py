"""xorl: not on the package index (the PyPI 'xorl' is another project), so no recipe CI can run.

Checked at togethercomputer/xorl 4d8c620b26ae (2026-08-22; its ``src/`` on ``PYTHONPATH``, Python 3.11,
torch 2.13 CPU, transformers 5.18, with einops, triton 3.6.0, torchdata and psutil), the newest snapshot
available here; xorl has no releases. Its version string there is ``25.10.17.dev1``."""

from harness.cases.frameworks import Framework

FRAMEWORK = Framework(
    "xorl", "xorl.distributed.fsdp2.clip_grad_norm", None,
    "it is not on the package index (the PyPI 'xorl' is another project): git clone "
    "https://github.com/togethercomputer/xorl, pip install einops triton==3.6.0 transformers torchdata psutil, "
    "and put its src/ on PYTHONPATH",
)
