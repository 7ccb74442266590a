"""Tied weights counted twice: copies along ``pp`` are summed as if they were distinct gradients.

An embedding tied to the output head lives on the first and the last stage with the same (all-reduced)
gradient; summing stage norms counts it once per stage (Megatron-LM PR #7228 / #7227: 40 vs 28.28,
x sqrt(2); DeepSpeed PR #1252, pipe-replicated parameters).
"""

from harness.cases.axes import MeshAxis

from ._shapes import replicas_summed

clip = replicas_summed(MeshAxis.PP)
