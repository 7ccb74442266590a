"""A stand-in framework adapter for the harness's own tests of what adapters get: a ``dress`` step, a
``backward`` step that delivers the gradients (or fails to), findings with who reaches them, and a
synthetic layout. The "framework" is the standard library's ``json`` (always installed), so nothing
here depends on a real framework being present; the clips are the reference's, or the reference's
norm halved (a FAIL with a finding)."""

from __future__ import annotations

import time
from typing import Any, Mapping

import torch
import torch.nn as nn

from harness.reference import clip_grad_norm as reference
from harness.cases.variant import Variant, declared_from_layout
from harness.cases.context import CaseContext
from harness.cases.injection import Injection
from harness.cases.layout import Layout, MeshSpec, Shard, param
from harness.cases.scenario import Scenario, ScenarioOptions
from harness.cases.frameworks import Framework
from harness.cases.target import Finding, Target, stock, synthetic

FAKE = Framework("fakefw", "json", None, "it is the standard library's json")


def dress(model: nn.Module, ctx: CaseContext) -> None:
    ctx.extras["dressed"] = True


def dress_fails(model: nn.Module, ctx: CaseContext) -> None:
    raise ImportError("cannot import name 'Thing' from 'fakefw.models' (a framework that does not import here)")


def deliver(model: nn.Module, ctx: CaseContext, grads: Mapping[str, torch.Tensor | None]) -> None:
    """The framework's path, exactly: each gradient as the layout says."""
    for name, p in model.named_parameters():
        p.grad = grads.get(name)


def deliver_doubled(model: nn.Module, ctx: CaseContext, grads: Mapping[str, torch.Tensor | None]) -> None:
    """A path that changes what it carries (a hook that sums two replicas, say)."""
    for name, p in model.named_parameters():
        g = grads.get(name)
        p.grad = None if g is None else g * 2


def deliver_stuck_on_rank_one(model: nn.Module, ctx: CaseContext, grads: Mapping[str, torch.Tensor | None]) -> None:
    """A framework backward that never returns on rank 1 (a hook waiting for a peer that never comes)."""
    if ctx.rank == 1:
        while True:
            time.sleep(3600)
    deliver(model, ctx, grads)


def half_norm(model: nn.Module, *, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """The reference's clip, reporting half the norm (the finding the table explains)."""
    return reference(model, max_norm=max_norm, norm_type=norm_type) / 2


HALF = Finding("*", None, "reports half the norm", stock("the fake trainer's default config"),
               repro="tests/fake_framework.py")
COMMON: dict[str, Any] = {"origin": "test fake_framework", "requires": FAKE}


class FakeFramework(Scenario):
    name = "fake_fw"
    summary = "two layouts of one dense model over dp, one of them synthetic for the fake framework"
    default_targets = ("fake-good", "reference")

    def variants(self, world_size: int, options: ScenarioOptions) -> list[Variant]:
        layout = Layout(MeshSpec.of(dp=world_size), (param("w", (4 * world_size, 3), dp=Shard(0)), param("b", (5,))))
        injection = Injection(seed=options.seed, dtype=options.dtype)
        return [Variant(f"dp={world_size} {kind}", layout, injection, declared_from_layout(layout), synthetic=why)
                for kind, why in (("stock", None), ("unreachable", "the fake trainer never lays gradients out so"))]


FakeFramework.targets = {t.name: t for t in (
    Target("fake-good", reference, "reference, delivered through the fake path", dress=dress, backward=deliver,
           **COMMON),
    Target("fake-badpath", reference, "reference, delivered doubled", dress=dress, backward=deliver_doubled,
           **COMMON),
    Target("fake-setup", reference, "a framework whose setup raises", dress=dress_fails, **COMMON),
    Target("fake-stuck-backward", reference, "a framework whose backward never returns on rank 1", dress=dress,
           backward=deliver_stuck_on_rank_one, **COMMON),
    Target("fake-half", half_norm, "half the norm", dress=dress, backward=deliver, findings=(HALF,), **COMMON),
)}
