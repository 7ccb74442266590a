"""The metamorphic check: same unique gradients, different layout => same norm and coefficient.

It needs no ground truth at all, which is why it is worth having beside the per-case checks: a clip
whose coefficient moves when the *same* expert gradients are merely redistributed over ranks is
wrong, whatever it reports.
"""

from __future__ import annotations

from dataclasses import dataclass

from .checks import CaseResult, coefficient_tolerance, tolerance
from .oracle import norms_agree


@dataclass
class MetamorphicResult:
    key: str
    scenario: str
    target: str
    norm_label: str
    dtype: str
    coefficients: dict[str, float]
    norms: dict[str, float]

    @property
    def gap(self) -> float:
        values = list(self.coefficients.values())
        return max(values) - min(values)

    @property
    def passed(self) -> bool:
        coefficient_ok = self.gap <= coefficient_tolerance(self.dtype) * max(self.coefficients.values())
        norms = list(self.norms.values())
        norm_ok = all(norms_agree(n, norms[0], tolerance(self.dtype)) for n in norms)
        return coefficient_ok and norm_ok


def metamorphic_groups(results: list[CaseResult]) -> list[MetamorphicResult]:
    """Group finished cases by (scenario, target, norm, dtype, bound, invariance key) over layouts."""
    groups: dict[tuple, MetamorphicResult] = {}
    for r in results:
        key = r.case.variant.invariance_key
        reported = r.reported[0] if r.reported else None
        if key is None or r.coefficient is None or reported is None:
            continue
        case = r.case
        gid = (case.scenario, case.target, case.norm_label, case.injection.dtype, case.max_norm, key)
        group = groups.setdefault(
            gid, MetamorphicResult(key, case.scenario, case.target, case.norm_label, case.injection.dtype, {}, {})
        )
        group.coefficients[case.variant.label] = r.coefficient
        group.norms[case.variant.label] = reported
    return [g for g in groups.values() if len(g.coefficients) >= 2]
