"""Scales a materialized copy: ``p.grad.full_tensor().mul_(coef)`` on DTensor gradients.

The norm is right and plain gradients are clipped in place, but a DTensor gradient is clipped
through ``full_tensor()``, which all-gathers the shards into a new tensor: the copy is scaled and
thrown away, the parameter's own shards never change. It models code written against plain tensors
and later handed FSDP2/TP DTensors (any ``.full_tensor()``, ``.redistribute()`` or ``.to_local()``
of a redistributed gradient used as if it were the gradient itself). No upstream report is known;
fuzzing with plain tensors only let it pass 60 examples, which is why the fuzzer draws DTensors.
"""

from torch.distributed.tensor import DTensor

from ._shapes import scales_a_copy

clip = scales_a_copy(lambda grad: grad.full_tensor() if isinstance(grad, DTensor) else grad)
