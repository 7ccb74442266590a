"""torch's clip holds the total of fp16 gradients' norms in fp16: a total past 65504 is inf, and every gradient
is scaled by 0.

``torch.nn.utils.clip_grad_norm_`` (through ``get_total_norm``) takes each gradient's norm with
``vector_norm``, which accumulates fp16 in fp32 but returns an fp16 norm, stacks those norms and takes the norm
of the stack, again in fp16. Gradients whose own norms each fit fp16 (here three of 40000) can have a total
that does not (69282): it is reported as inf, the coefficient ``max_norm / (inf + 1e-6)`` is 0, and every
gradient is silently zeroed (``error_if_nonfinite`` is False by default). Plain tensors, one process: no
sharding is involved (the DTensor reduction's own fp16 overflow is ``repro_fp16_norm_partial.py``). Known
upstream in effect: facebookresearch/pytext PR #1514 replaced torch's utility for fp16 training because it
"ends up setting the gradients of the model to 0".

Who reaches it: a loop that calls ``clip_grad_norm_`` on fp16 gradients (fp16 parameters without fp32 master
gradients) whose global norm passes 65504, e.g. with a loss scale still applied (direct call; torch 2.13.0).

    torchrun --nproc_per_node=2 scenarios/fsdp2/repro_fp16_total_overflow.py

Prints, on rank 0 (torch 2.13.0): ``scale=20000 reported=inf true=69282.032303 ratio=inf zeroed=1``.
"""

from __future__ import annotations

import math

import torch


def main() -> None:
    import os

    scale = 20000.0
    grads = [torch.full((4,), scale, dtype=torch.float16) for _ in range(3)]  # each norm 2 x 20000: inside fp16
    params = []
    for grad in grads:
        p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
        p.grad = grad
        params.append(p)
    true = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    reported = float(torch.nn.utils.clip_grad_norm_(params, max_norm=1.0))
    zeroed = all(bool(torch.all(g == 0)) for g in grads)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"scale={scale:g} reported={reported} true={true:.6f} ratio={reported / true} zeroed={int(zeroed)}")


if __name__ == "__main__":
    main()
