"""CP replicas summed: context-parallel ranks' identical gradients are counted once per rank.

Context parallel splits the sequence, not the parameters: after the gradient all-reduce every ``cp``
rank holds the same gradient, and a norm reduced over ``dp x cp`` as if they were shards comes out
x sqrt(cp). No upstream report of it is known: it is VeOmni #184's mechanism (HSDP replicas summed)
on the context-parallel axis, which every framework with CP has to get right the same way.
"""

from harness.cases.axes import MeshAxis

from ._shapes import replicas_summed

clip = replicas_summed(MeshAxis.CP)
