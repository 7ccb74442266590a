"""``harness.audit``: judge a clip function on your own model, after your own backward, in your own launch.

    report = harness.audit(model, lambda: engine.clip_grad_norm(max_norm), max_norm=max_norm, norm_type=2.0)
    if dist.get_rank() == 0:
        print(report.describe())           # the same words as a clipcheck case: checks, signature, blame

Called on every rank of the job (under torchrun, DeepSpeed's launcher, accelerate launch, SLURM), after
the backward and before the optimizer step, it answers "does this clip count every logical gradient
exactly once here?" without a scenario or an adapter: the truth is measured from the gradients' bits
(a gradient counts once per set of ranks holding bit-identical copies of it), the clip is called once
and judged by the harness's own checks (``harness.judge``), and the measured layout can be saved and
replayed on CPU ranks in CI (``report.save(path)``, ``clipcheck run --from-audit PATH --target T``).

* ``audit(model, clip, ...)``: a plain function; ``clip`` is called with no arguments, once;
* ``auditing(model, owner, "name", ...)``: a context manager that audits a clip someone else calls
  (a trainer's ``engine.step()`` calling ``clip_fp32_gradients``): ``owner.name`` is wrapped for the
  block, its first call audited, and its value returned to the caller as it was.

How it decides, and its limits: docs/audit.md.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from harness.errors import ClipcheckInputError
from harness.run.audit.audit_report import AuditReport  # the public type, defined once where run_audit builds it

DEFAULT_TIMEOUT_S = 60.0


def audit(model: nn.Module, clip: Callable[[], Any], *, max_norm: float, norm_type: float = 2.0,
          mesh: DeviceMesh | None = None, restore: bool = False, blame: bool = True,
          timeout_s: float = DEFAULT_TIMEOUT_S, label: str | None = None) -> AuditReport:
    """Judge ``clip`` (called once, with no arguments, on every rank) on ``model``'s gradients as they are.

    ``max_norm`` / ``norm_type``: what the clip clips to (the expected coefficient is
    ``min(1, max_norm / (true + 1e-6))``). ``mesh``: the job's DeviceMesh, for the declared-vs-measured
    placement audit (DTensor parameters bring theirs). ``restore``: keep a copy of the gradients, measure
    the coefficient exactly, blame parameter groups when the norm is wrong (the clip called once per
    group), and put the gradients back as they were before the audit; without it nothing is copied and
    the gradients stay as the clip left them. ``timeout_s``: the collective timeout the guard allows
    the clip (a rank stuck past ``2 * timeout_s + 10`` s is reported hung). ``label``: the clip's name
    in the report."""
    import math

    from harness.run.audit.session import clip_label, run_audit

    if not (math.isfinite(max_norm) and max_norm > 0):
        raise ClipcheckInputError(f"max_norm must be a positive finite number, got {max_norm!r}")
    if math.isnan(norm_type) or norm_type <= 0:
        raise ClipcheckInputError(f"norm_type must be positive or inf, got {norm_type!r}")
    if not timeout_s > 0:
        raise ClipcheckInputError("timeout_s must be positive")
    returned: list[Any] = []

    def call() -> Any:
        returned.append(clip())
        return returned[-1]

    report = run_audit(model, call, max_norm=float(max_norm), norm_type=float(norm_type), mesh=mesh,
                       restore=restore, blame=blame, timeout_s=float(timeout_s), label=label or clip_label(clip))
    report.value = returned[0] if returned else None  # as the clip returned it (run_audit reads a DTensor whole)
    return report


@dataclass
class Auditing:
    """The hook ``auditing`` installs: its reports, one per audited call (every rank)."""

    reports: list[AuditReport] = field(default_factory=list)

    @property
    def report(self) -> AuditReport | None:
        """The first audited call's report (None while no call was audited)."""
        return self.reports[0] if self.reports else None


@contextlib.contextmanager
def auditing(model: nn.Module, owner: Any, name: str, *, max_norm: float, norm_type: float = 2.0,
             calls: int = 1, **options: Any) -> Iterator[Auditing]:
    """Audit the clip someone else calls: inside the block, ``owner.<name>`` (a method of an engine, a
    function of a module) is wrapped; its first ``calls`` calls are audited (``audit`` with the call as
    the clip, ``options`` as its keywords) and return what the clip returned, the later ones run as
    they are. The original is put back when the block ends.

        with harness.auditing(model, engine, "clip_fp32_gradients", max_norm=1.0) as hook:
            engine.step()                      # the engine's own step calls its clip
        print(hook.report.describe())
    """
    original = getattr(owner, name)
    own = name in getattr(owner, "__dict__", {})
    hook = Auditing()
    # taken once, here: popped inside the wrapper, the first audited call would take the user's label and
    # every later one (``calls > 1``) be named after the owner
    label = options.pop("label", None) or f"{type(owner).__name__}.{name}"

    def audited(*args: Any, **kwargs: Any) -> Any:
        if len(hook.reports) >= calls:
            return original(*args, **kwargs)
        report = audit(model, lambda: original(*args, **kwargs), max_norm=max_norm, norm_type=norm_type,
                       label=label, **options)
        hook.reports.append(report)
        return report.value

    setattr(owner, name, audited)
    try:
        yield hook
    finally:
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)
