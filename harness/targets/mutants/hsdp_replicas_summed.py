"""HSDP replicas summed: the norm is SUMmed over the whole data-parallel world, replicas included.

Under HSDP every ``dp_replicate`` group holds the same shards; reducing over shard x replicate
counts each of them dp_replicate times (VeOmni #184, fixed by PRs #185 and #862; hyper-parallel
#279): x sqrt(dp_replicate).
"""

from harness.cases.axes import MeshAxis

from ._shapes import replicas_summed

clip = replicas_summed(MeshAxis.DP_REPLICATE)
