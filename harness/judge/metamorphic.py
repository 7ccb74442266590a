"""The metamorphic check: same unique gradients, different layout => same norm and coefficient.

It needs no ground truth at all, which is why it is worth having beside the per-case checks: a clip
whose coefficient moves when the *same* expert gradients are merely redistributed over ranks is
wrong, whatever it reports. It reads case records (the JSON Lines form), so a single launch and a
launcher merging several agree on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from harness.judge.tolerance import UNIT_ROUNDOFF, norm_rtol
from harness.judge.truth import norms_agree
from harness.cases.variant import bound_label


@dataclass
class MetamorphicResult:
    world_size: int
    key: str
    scenario: str
    target: str
    norm_label: str
    dtype: str
    coefficients: dict[str, float]
    norms: dict[str, float]
    bound: str = ""  # the bound label ("x0.5": a ratio of the true norm, or an absolute max_norm)
    rtol: float = 0.0
    """The largest norm tolerance of the group's cases (each derived from its dtype and elements)."""

    @property
    def gap(self) -> float:
        values = list(self.coefficients.values())
        return max(values) - min(values)

    @property
    def passed(self) -> bool:
        rtol = max(self.rtol, norm_rtol(self.dtype))
        # two coefficients, each within its norm's error and one rounding of the coefficient of the truth
        coefficient_ok = self.gap <= 2 * (rtol + 2 * UNIT_ROUNDOFF[self.dtype]) * max(self.coefficients.values())
        norms = list(self.norms.values())
        norm_ok = all(norms_agree(n, norms[0], 2 * rtol) for n in norms)
        return coefficient_ok and norm_ok


def metamorphic_groups(records: Iterable[Mapping[str, Any]]) -> list[MetamorphicResult]:
    """Group judged case records by (world, scenario, target, norm, dtype, bound, invariance key)."""
    groups: dict[tuple, MetamorphicResult] = {}
    for r in records:
        key = r.get("invariance_key")
        reported = r["reported"][0] if r.get("reported") else None
        if r.get("type") != "case" or key is None or r.get("coefficient") is None or not isinstance(reported, float):
            continue
        bound = r.get("clip_ratio") if r.get("clip_ratio") is not None else r["max_norm"]
        gid = (r["world_size"], r["scenario"], r["target"], r["norm"], r["dtype"], bound, key)
        group = groups.setdefault(gid, MetamorphicResult(r["world_size"], key, r["scenario"], r["target"], r["norm"],
                                                         r["dtype"], {}, {}, bound_label(r.get("clip_ratio"),
                                                                                         r["max_norm"])))
        group.coefficients[r["layout"]] = r["coefficient"]
        group.rtol = max(group.rtol, float(r.get("tolerance") or 0.0))
        group.norms[r["layout"]] = reported
    return [g for g in groups.values() if len(g.coefficients) >= 2]
