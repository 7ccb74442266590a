"""TP replicas summed: copies along ``tp`` are counted as if they were distinct shards.

Norm weights, routers and other TP-replicated parameters then count tp_size times (NeMo-RL #3788,
ROCm TransformerEngine #715, xorl's non-EP bucket): the norm comes out sqrt(tp) too high on them.
"""

from harness.cases.axes import MeshAxis

from ._shapes import replicas_summed

clip = replicas_summed(MeshAxis.TP)
