"""How ``harness.audit`` reads what the clip did to the gradients' values (``effects.ReadsTheCall``): a
second pass over the post-call gradients where they lie (the same sums, row norms and samples as the first,
and the digests of the gradients that may be copies of another holding), then the coefficients from the
copy ``restore=True`` keeps (``with_copy``), or from both passes' statistics without one (``without_copy``),
and the non-finite policies the same way. Everything else about the call the audit measures as a case
does (``effects.rank_effects``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch

from harness.judge.records import Coefficients
from harness.run.audit.gradient_pass import GradientPass, Stats
from harness.run.audit.with_copy import blocked_coefficients
from harness.run.audit.without_copy import cheap_policies, cheap_scale
from harness.run.case.effects import POLICIES, canonical_nans, consistent_policies
from harness.run.case.measure import linear_digest

Grads = Mapping[str, "torch.Tensor | None"]


def digestible(grad: torch.Tensor | None, nonfinite: bool) -> torch.Tensor:
    """What is hashed of a gradient: its bits, its NaNs canonical in a case with non-finite values
    (NaN payloads and signs carry no meaning: ``effects.canonical_nans``)."""
    assert grad is not None
    canonical = canonical_nans({"g": grad})["g"] if nonfinite and grad.is_floating_point() else grad
    assert canonical is not None
    return canonical


@dataclass
class AuditReading:
    """The audit's reading of one call. ``before``: the first pass's statistics per gradient; ``copied``:
    the gradients that may be copies (hashed after the call too); ``copies``: the gradients as they were,
    where ``restore=True`` kept them, else None; ``digests_before``: the digests taken before the call.
    ``after`` holds the second pass's statistics once ``coefficients`` has run."""

    norm_type: float
    before: Mapping[str, Stats]
    copied: set[str]
    nonfinite: bool
    copies: Grads | None
    digests_before: Mapping[str, str]
    after: dict[str, Stats] = field(default_factory=dict)

    def coefficients(self, post: Grads) -> Coefficients:
        second = GradientPass(self.norm_type)
        self.after = {n: second.add(g) for n, g in post.items() if g is not None}
        second.finish()
        for name in self.copied & set(self.after):
            self.after[name].digest = linear_digest(digestible(post[name], self.nonfinite))
        if self.copies is not None:
            scale, vanished = blocked_coefficients(self.copies, post)
        else:
            scale = {n: entry for n in self.before if n in self.after
                     if (entry := cheap_scale(self.before[n], self.after[n])) is not None}
            vanished = [n for n in self.before if post.get(n) is None]
        return {"scale": scale, "vanished": vanished,
                "became_nonfinite": [n for n, s in self.after.items()
                                     if n in self.before and self.before[n].finite and not s.finite]}

    def policies(self, post: Grads) -> list[str] | None:
        if self.copies is not None:
            return consistent_policies(self.copies, post)
        if not self.before:
            return None
        ok = dict.fromkeys(POLICIES, True)
        for name, stats in self.before.items():
            one = cheap_policies(stats, post.get(name), self.digests_before.get(name))
            ok = {k: ok[k] and one[k] for k in ok}
        return [p for p, fine in ok.items() if fine]
