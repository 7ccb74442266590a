"""What a clip function leaves behind once it has returned: the model state beyond the gradients'
values, and changes that come late.

The per-case effects (``effects``) are measured right after the call. A target can still act after
that: a thread it started restores the unscaled gradients 50 ms later, a background worker flips a
flag. And it can change what the value snapshots do not see: a parameter's ``requires_grad`` (training
silently stops), a DTensor gradient's wrapper (its ``.data`` swapped for a tensor of another shape or
dtype while the local shard stays as it was). So:

* ``ModelState``: the parameters' ``requires_grad`` flags and the DTensor gradients' wrapper metadata
  (global shape, dtype, placements), before and after the call;
* ``fingerprint``: digests of every gradient's and parameter's bytes, plus the state above, right
  after the call; ``settled_changes`` waits (bounded) for the threads the call started to finish, then takes
  it again: any difference is a *late* change, named with the threads still running;
* ``LateWatch``: the same comparison once more at the start of the next case (the model is kept
  that long), so a change that comes after the case's own exchanges is still pinned on its case.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from harness.clipmath import local_tensor
from harness.run.case.measure import bits_digest

SETTLE_S = 2.0
"""How long a case waits for the threads its target started before it re-checks the model (a thread
still running after that is named; it is checked once more before the next case)."""


PLAIN = "a plain tensor"
"""The wrapper text of a gradient that is not a DTensor."""


@dataclass(frozen=True)
class ModelState:
    """What a clip must not change besides gradient values: parameter flags, gradient wrappers (plain
    or DTensor, and the DTensor's metadata) and the storage each local gradient lives in."""

    requires_grad: dict[str, bool]
    wrappers: dict[str, str]
    """Every gradient's wrapper as text, by parameter name: ``PLAIN``, or a DTensor's global shape, dtype
    and placements. An optimizer (torch's AdamW, foreach or not) refuses a mix of plain and DTensor
    gradients it was not built for, so a plain gradient becoming a DTensor, or the reverse, is a fault."""
    storage: dict[str, int] = field(default_factory=dict)
    """Every gradient's local storage address (``data_ptr``): a clip scales in place; ``p.grad = p.grad * c``
    gives the right values in a new tensor, and whatever aliases the old one (a framework's bucket, its
    ``main_grad``, an optimizer's view) keeps the unscaled gradient."""

    @classmethod
    def of(cls, model: nn.Module) -> "ModelState":
        params = dict(model.named_parameters())
        grads = {n: p.grad for n, p in params.items() if p.grad is not None}
        return cls({n: p.requires_grad for n, p in params.items()},
                   {n: wrapper_text(g) for n, g in grads.items()},
                   {n: _address(local_tensor(g)) for n, g in grads.items()})

    def flag_changes(self, after: "ModelState") -> dict[str, str]:
        """Parameters whose ``requires_grad`` changed (or that vanished), with how."""
        return {n: f"requires_grad {flag} -> {after.requires_grad.get(n, 'gone')}"
                for n, flag in self.requires_grad.items() if after.requires_grad.get(n) != flag}

    def wrapper_changes(self, after: "ModelState") -> dict[str, str]:
        """Gradients whose wrapper changed kind (plain <-> DTensor), or whose DTensor wrapper now says
        another shape, dtype or placement."""
        changes = {}
        for n, meta in self.wrappers.items():
            now = after.wrappers.get(n)
            if now is None or now == meta:
                continue
            if PLAIN in (now, meta):
                changes[n] = f"it is now {_kind(now)}, was {_kind(meta)}"
            else:
                changes[n] = f"its DTensor wrapper says {now}, was {meta}"
        return changes

    def created(self, after: "ModelState") -> list[str]:
        """Parameters, trainable or frozen, without a gradient before the call and with one after it."""
        return [n for n in after.wrappers if n not in self.wrappers]

    def replaced(self, after: "ModelState") -> list[str]:
        """Gradients present before and after whose local tensor now lives in other storage."""
        return [n for n, ptr in self.storage.items() if n in after.storage and after.storage[n] != ptr]


def _address(t: torch.Tensor) -> int:
    """Where a gradient's values live; -1 for a tensor without strided storage (sparse: ``mangled``)."""
    return t.data_ptr() if t.layout == torch.strided else -1


def _digest(t: torch.Tensor) -> str:
    return bits_digest(t) if t.layout == torch.strided else f"layout {t.layout}"


def _kind(text: str) -> str:
    return text if text == PLAIN else f"a DTensor {text}"


def wrapper_text(grad: torch.Tensor) -> str:
    if not isinstance(grad, DTensor):
        return PLAIN
    return f"{tuple(grad.shape)} {str(grad.dtype).replace('torch.', '')} {list(map(str, grad.placements))}"


def fingerprint(model: nn.Module, names: Sequence[str]) -> dict[str, str]:
    """Digests of the model as the clip left it: each gradient's local bytes (``names`` first, then
    every other parameter's, a frozen one's included: its gradient must stay None), each parameter's
    local bytes, flags and gradient wrappers."""
    params = dict(model.named_parameters())
    out: dict[str, str] = {}
    for name in [*names, *(n for n in params if n not in set(names))]:
        grad = params[name].grad if name in params else None
        out[f"gradient {name}"] = "none" if grad is None else _digest(local_tensor(grad))
    for name, p in params.items():
        # the local tensor, never an op on the DTensor: after a failed case the groups it was made with are
        # gone, and a DTensor op would cache a plan naming them for the next case's DTensors
        out[f"parameter {name}"] = bits_digest(local_tensor(p))
    state = ModelState.of(model)
    out.update({f"flag {n}": str(v) for n, v in state.requires_grad.items()})
    out.update({f"wrapper {n}": v for n, v in state.wrappers.items()})
    return out


def late_changes(before: dict[str, str], after: dict[str, str], limit: int = 4) -> list[str]:
    """What differs between two fingerprints, as ``gradient w``, ``parameter b``, ``flag w`` ..."""
    changed = [key for key in before.keys() | after.keys() if before.get(key) != after.get(key)]
    changed.sort()
    return changed[:limit] + ([f"(+{len(changed) - limit} more)"] if len(changed) > limit else [])


HARNESS_THREADS = "clipcheck-"
"""The prefix of the harness's own threads (its watchdog starts on first use, inside a call)."""


def threads_started(before: set[threading.Thread]) -> list[threading.Thread]:
    """Threads alive now that were not before (started by the call, still running), the harness's
    own left out."""
    return [t for t in threading.enumerate()
            if t not in before and t.is_alive() and not t.name.startswith(HARNESS_THREADS)]


def settled_changes(before_call: set[threading.Thread], model: nn.Module, names: Sequence[str],
           baseline: dict[str, str], budget_s: float = SETTLE_S) -> tuple[list[str], list[str]]:
    """Wait up to ``budget_s`` for the threads the call started, then compare the model with
    ``baseline``: (what changed late, the threads still running). No wait without such threads."""
    started = threads_started(before_call)
    if not started:
        return [], []
    deadline = time.monotonic() + budget_s
    for thread in started:
        thread.join(max(0.0, deadline - time.monotonic()))
    running = [t.name for t in started if t.is_alive()]
    return late_changes(baseline, fingerprint(model, names)), running


@dataclass
class LateWatch:
    """The previous case's model and its fingerprint, checked once more before the next case."""

    model: nn.Module
    names: list[str]
    baseline: dict[str, str]
    running: list[str] = field(default_factory=list)

    def changes(self) -> list[str]:
        with torch.no_grad():
            return late_changes(self.baseline, fingerprint(self.model, self.names))


@dataclass(frozen=True)
class GlobalState:
    """The process-wide torch settings a clip must leave as it found them: a clip that turns grad mode off
    (``torch.set_grad_enabled(False)`` as a statement) or sets the default dtype to float64 "for exact
    accumulation" and never restores it changes the training around it, and every later target of the
    same ranks too (one that computes its coefficient as a default-dtype tensor then passes at fp64).
    Snapshot before the call, compared after it (a ``contract`` fault naming what changed), then restored."""

    grad_enabled: bool
    default_dtype: torch.dtype
    default_device: str
    deterministic: bool
    deterministic_warn_only: bool
    anomaly: bool

    @classmethod
    def of(cls) -> "GlobalState":
        return cls(torch.is_grad_enabled(), torch.get_default_dtype(), str(torch.get_default_device()),
                   torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                   torch.is_anomaly_enabled())

    def changes(self, after: "GlobalState") -> list[str]:
        """What differs, as ``grad mode True -> False``, ``default dtype float32 -> float64`` ..."""
        words = {"grad_enabled": "grad mode", "default_dtype": "default dtype", "default_device": "default device",
                 "deterministic": "deterministic algorithms", "deterministic_warn_only": "deterministic warn-only",
                 "anomaly": "anomaly detection"}
        out = []
        for key, word in words.items():
            old, new = getattr(self, key), getattr(after, key)
            if old != new:
                out.append(f"{word} {str(old).replace('torch.', '')} -> {str(new).replace('torch.', '')}")
        return out

    def restore(self) -> None:
        torch.set_grad_enabled(self.grad_enabled)
        torch.set_default_dtype(self.default_dtype)
        torch.set_default_device(None if self.default_device == "cpu" else self.default_device)
        torch.use_deterministic_algorithms(self.deterministic, warn_only=self.deterministic_warn_only)
        torch.autograd.set_detect_anomaly(self.anomaly)


def global_state_fault(before: GlobalState) -> str | None:
    """The fault of a call that changed the process-wide torch settings (restored now), or None."""
    changed = before.changes(GlobalState.of())
    if not changed:
        return None
    before.restore()
    return f"changed the process-wide torch settings and left them so ({'; '.join(changed)}; restored now)"
