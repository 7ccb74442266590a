"""The contract of a target: what an extender writes to put a clip function under test (``Target``) and
to say what its known failures are (``Finding``, ``Reach``). It lives beside the scenario contract
(``cases.scenario``), which names the targets a scenario brings; the built-in targets and the way a name
becomes a target are ``harness.targets``.

The call, the same for every target: ``fn(model, *, max_norm, norm_type) -> total_norm`` on every rank,
clipping the gradients in place and returning the total norm as a float, a 0-dim (or 1-element) tensor,
or a DTensor. The mesh, groups and declared plan come from ``harness.context(model)``.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Callable, Literal, TypedDict

import torch

from harness.cases.frameworks import Framework

ClipFn = Callable[..., Any]


ReachKind = Literal["stock", "direct-call", "synthetic"]
REACH_KINDS: tuple[ReachKind, ...] = ("stock", "direct-call", "synthetic")


@dataclass(frozen=True)
class Reach:
    """Who meets a finding, which decides whether it is one: a FAIL is a claim about someone else's
    code, and what a framework's users actually run is what makes it worth their time.

    * ``stock``: a documented configuration of the framework's own trainer reaches it (``how`` names
      the configuration);
    * ``direct-call``: only a custom training loop that calls the clip function itself does (``how``
      names the call);
    * ``synthetic``: no known path reaches it (``how`` says what prevents it); the layout is kept as a
      regression layout, runs only when asked for (``--synthetic``) and is never called a finding.
    """

    kind: ReachKind
    how: str

    def __post_init__(self) -> None:
        if self.kind not in REACH_KINDS:
            raise ValueError(f"reach kind must be one of {REACH_KINDS}, got {self.kind!r}")
        if not self.how.strip():
            raise ValueError("a reach says how (the config, the call, or what keeps every path from it)")

    @property
    def reached(self) -> bool:
        """Whether some user meets it (``stock`` or ``direct-call``)."""
        return self.kind != "synthetic"

    def describe(self) -> str:
        return f"{self.kind}: {self.how}"


def stock(how: str) -> Reach:
    return Reach("stock", how)


def direct_call(how: str) -> Reach:
    return Reach("direct-call", how)


def synthetic(how: str) -> Reach:
    return Reach("synthetic", how)


class FindingRecord(TypedDict):
    """What a real framework's FAIL is (``Finding``), and who reaches it."""

    upstream: str | None
    note: str
    reach: Literal["stock", "direct-call", "synthetic"]
    how: str
    owner: str | None
    repro: str | None
    text: str
    """The one line the reports show: the upstream report or 'new finding', the mechanism."""


@dataclass(frozen=True)
class Finding:
    """What a real framework's failures on some layouts are, for the reports and the compatibility
    table: a known upstream report, or a new finding with what a user should report upstream, and in
    both cases who reaches it (``reach``). A FAIL that matches no finding of its target is shown as
    unexplained (nobody has looked at it yet)."""

    layouts: str
    """fnmatch pattern on the variant label ("*tp experts plain*")."""
    upstream: str | None
    """The matching report ("meta-pytorch/torchtune #2420"); None for a new finding."""
    note: str
    """The mechanism in a few words; for a new finding, what to report (with the replay command)."""
    reach: Reach
    """Who meets it: the trainer's stock configuration, a direct call, or nobody known (synthetic)."""
    norms: tuple[str, ...] = ()
    """Norm labels it applies to ("L2", "Linf"); empty for every norm."""
    owner: str | None = None
    """Whose code holds the mechanism when it is not the target's framework ("pytorch/pytorch"): a
    finding several frameworks inherit is filed once, under its owner."""
    repro: str | None = None
    """The standalone reproduction (``scenarios/<framework>/repro_<finding>.py``: the framework's own
    API, no clipcheck), so that the finding can be filed upstream as it stands."""

    def matches(self, layout: str, norm: str) -> bool:
        return fnmatch.fnmatchcase(layout, self.layouts) and (not self.norms or norm in self.norms)

    def describe(self) -> str:
        owner = f" (filed under {self.owner})" if self.owner else ""
        if self.upstream:
            return f"{self.upstream}: {self.note}{owner}"
        kind = "new finding" if self.reach.reached else "synthetic regression layout"
        return f"{kind}: {self.note}{owner}"

    def record(self) -> FindingRecord:
        return {"upstream": self.upstream, "note": self.note, "reach": self.reach.kind, "how": self.reach.how,
                "owner": self.owner, "repro": self.repro, "text": self.describe()}


def finding_for(findings: tuple[Finding, ...], layout: str, norm: str) -> Finding | None:
    """The first of ``findings`` that explains a FAIL on ``layout`` with ``norm``; None if none does."""
    return next((f for f in findings if f.matches(layout, norm)), None)


@dataclass(frozen=True)
class Target:
    """A clip function under test, and what it needs.

    * ``scenarios``: the only scenarios it can run with (it models their framework), None for any.
    * ``dtensor_only``: it builds DTensors over the whole mesh, so a layout with parameters on some
      ranks only is not a valid combination for it.
    * ``dtypes`` / ``norm_types``: what it supports at all, None for anything; other combinations
      are dropped (with their reason) rather than reported as failures.
    * ``requires``: a third-party framework; where it is missing, the target's cases are skipped.
    * ``dress``: ``dress(model, ctx)``, run on every rank before the gradients are injected, to set the
      model up the way the framework would (its marks, meshes, groups, wrappers). It may replace
      parameters, as long as names and local shapes stay those of the layout.
    * ``backward``: ``backward(model, ctx, grads)``, for a framework that acts on gradients between its
      backward and its clip (hooks, reduce-scatter, buckets, casts): instead of the harness writing
      ``grads`` (this rank's gradients by parameter name, None where it has none) into ``.grad``, it
      produces them through the framework's own path (``harness.run.case.delivery`` checks that exactly
      they arrived). None where the framework does nothing to gradients on the way to the clip.
    * ``findings``: what its known failures are (``Finding``), for the reports and the compatibility
      table.
    * ``in_place``: whether its clip must scale each gradient in the storage it found it in (every clip,
      so the default); False only for a framework whose own clip legitimately writes new gradient tensors
      (ColossalAI's ZeRO: its clipped master partitions are gathered back into a fresh ``.grad``), whose
      replaced gradients are then not a contract fault.
    * ``refuses``: ``refuses(variant) -> reason | None``, for layouts the framework itself rejects
      before any clip runs (torchtitan raises on weight tying under PP, say): such cases are dropped
      and counted with the reason, since judging a clip the framework never lets run says nothing.
    """

    name: str
    fn: ClipFn
    summary: str
    origin: str = "built-in"
    dtensor_only: bool = False
    scenarios: tuple[str, ...] | None = None
    dtypes: tuple[str, ...] | None = None
    norm_types: tuple[float, ...] | None = None
    requires: Framework | None = None
    dress: Callable[..., None] | None = None
    backward: Callable[..., None] | None = None
    refuses: Callable[[Any], str | None] | None = None
    findings: tuple[Finding, ...] = ()
    in_place: bool = True

    def unavailable(self) -> str | None:
        return None if self.requires is None else self.requires.unavailable()

    @property
    def runs_synthetic(self) -> bool:
        """Whether it runs a scenario's synthetic (regression) layouts without ``--synthetic``: only the
        harness's own targets do. A framework's adapter or a user's clip meets them on request, since no
        known trainer path hands a clip those gradients and a FAIL there is no finding."""
        return self.requires is None and self.origin != "user"

    def framework_version(self) -> str | None:
        """'deepspeed 0.19.8', 'torch 2.13.0+cpu' for torch's own clips; None for the harness's own."""
        if self.requires is not None:
            return None if self.unavailable() else f"{self.requires.name} {self.requires.version()}"
        if self.name.startswith("torch"):
            return f"torch {torch.__version__}"
        return None
