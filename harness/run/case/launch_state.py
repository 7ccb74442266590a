"""What one rank keeps from case to case within a launch or a warm pool, owned by the host that runs
the cases (``hosts``), not by the process groups (``DistWorld``): a world's groups and store serve any
task, while these caches are about the cases of one plan."""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.judge.blame import BlameKey
from harness.judge.records import CaseResult
from harness.run.case.model_state import LateWatch
from harness.run.case.truth_cache import TruthCache


@dataclass
class LaunchState:
    """One rank's memory of the cases run so far."""

    truth_cache: TruthCache = field(default_factory=TruthCache)
    """Ground truth measured once per layout variant and norm type (``truth_cache``)."""
    late_watch: LateWatch | None = None
    """The last case's model, checked again before the next case (``model_state.LateWatch``)."""
    blamed: dict[BlameKey, CaseResult] = field(default_factory=dict)
    """Rank 0: the weighings of this plan, for reuse (``blame_reruns``)."""
    honest: dict[BlameKey, bool] = field(default_factory=dict)
    """Rank 0: whether a lying-plan case passed on the honest plan (``blame_reruns``)."""
    established: dict[BlameKey, tuple[int, dict[str, CaseResult | None]]] = field(default_factory=dict)
    """Rank 0: the groups run alone to establish their counting, by the case they ran on (``blame_reruns``)."""

    def forget_plan(self) -> None:
        """A new plan starts on the same ranks: no weighing of an earlier one is reused (the same target
        name may now be another function)."""
        self.blamed.clear()
        self.honest.clear()
        self.established.clear()
