"""torchtitan (pinned, without its training-stack dependencies, which the adapter does not use)."""

from harness.cases.frameworks import Framework


RELEASES = ("0.3.0",)
"""The releases that install here and run the adapter, oldest first; 0.3.0 is the newest on the index
(``pip index versions torchtitan``: 0.3.0, 0.2.2, 0.2.1, 0.2.0, 0.1.0, 0.0.2). The adapter calls
``torchtitan.distributed.fsdp.apply_fsdp_to_decoder``, new in 0.3.0; 0.2.x import triton at
``import torchtitan`` and keep their FSDP wrapping per model (``models/llama4/infra/parallelize.py``).
Their clip is the same: 0.2.2's ``clip_grad_norm_`` is 0.3.0's line for line, 0.2.0's calls
``full_tensor()`` on the non-EP norm unconditionally (the crash of torchtitan PR #2270 when every
parameter is on the expert mesh), and both reproduce ``repro_experts_without_ep_dim.py`` as 0.3.0 does;
0.1.0 has no ``ep_enabled``."""

FRAMEWORK = Framework(
    "torchtitan", "torchtitan.distributed.utils", "torchtitan",
    "pip install --no-deps torchtitan==0.3.0 && pip install spmd_types==0.2.3 tyro",
    recipe=("pip install --no-deps torchtitan==0.3.0", "pip install spmd_types==0.2.3 tyro"),
    releases=RELEASES)
