"""The constructive truth: the float64 norm of a variant's logical gradients, from the value
generator alone, with no communication at all. It is a function of the spec, so planning (the
bounds are ratios of it) and the judge (``harness.judge.truth`` cross-checks it with the measured
truth) share it.
"""

from __future__ import annotations

from harness.clipmath import combine, pow_sum, root
from harness.cases.variant import Variant
from harness.cases.injection import Injection, logical_grad
from harness.cases.layout import Layout


def gradient_pow_sums(layout: Layout, injection: Injection, norm_type: float) -> list[float]:
    """Each trainable logical gradient's float64 sum |g|^p (max |g| for the inf norm), from the generator
    alone: what ``constructive_norm`` combines, and each gradient's own norm to the power p."""
    return [pow_sum(logical_grad(layout, injection, spec), norm_type) for spec in layout.trainable]


def constructive_norm(layout: Layout, injection: Injection, norm_type: float) -> float:
    """float64 norm of the logical gradients, from the generator alone: no communication."""
    total = 0.0
    for part in gradient_pow_sums(layout, injection, norm_type):
        total = combine(total, part, norm_type)
    return root(total, norm_type)


def variant_truth(variant: Variant, norm_type: float) -> float:
    """``constructive_norm`` of a variant, computed once per (variant, norm type) and kept on the
    variant (``Variant.truths``): planning needs it for every target and bound of the variant (the
    clip ratios scale it), the fuzzer to draw a bound, and rank 0 again to judge; hashing every
    logical element each time made planning a large share of a launch's CPU (docs/performance.md,
    "Figures cited by the code")."""
    truths = variant.truths
    if norm_type not in truths:
        truths[norm_type] = constructive_norm(variant.layout, variant.injection, norm_type)
    return truths[norm_type]
