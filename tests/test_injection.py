"""Gradient injection: true replicas are bit-identical, distinct slices never are, and the logical
gradient is exactly the union of the slices. Every rank is simulated in-process (injection is a pure
function of the layout and the rank), so these need no process group."""

import math

import pytest
import torch

from harness.cases.injection import Injection, local_grad, logical_grad
from harness.cases.layout import Layout, LayoutError, MeshSpec, Shard, param
from harness.run.case.measure import bit_words
from harness.cases.constructive import constructive_norm
from harness.cases.values import box_values, full_box, logical_values, magnitude, stream_key, uniform_from_indices
import harness.targets.builtin_scenarios  # noqa: F401  (maps harness.scenarios in a checkout)
from harness.scenarios.deepspeed.scenario import autoep_layout
from harness.scenarios.xorl.scenario import adapter_layout


def _by_box(layout, injection, spec):
    groups = {}
    for r in range(layout.mesh.world_size):
        g = local_grad(layout, injection, spec, r)
        box = layout.local_box(spec, r)
        if g is not None:
            groups.setdefault(box, []).append(bit_words(g))
    return groups


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16", "fp64"])
@pytest.mark.parametrize("hybrid", [False, True])
def test_replicas_identical_and_shards_distinct(dtype, hybrid):
    layout = adapter_layout(ep_size=2, ep_fsdp=2, experts=8, hybrid_shared=hybrid)
    injection = Injection(seed=3, dtype=dtype)
    for spec in layout.trainable:
        groups = _by_box(layout, injection, spec)
        for copies in groups.values():
            assert all(torch.equal(copies[0], c) for c in copies[1:]), spec.name
        firsts = [copies[0] for copies in groups.values()]
        for i in range(len(firsts)):
            for j in range(i + 1, len(firsts)):
                assert not torch.equal(firsts[i], firsts[j]), spec.name


def test_values_depend_only_on_logical_index():
    shape = (4, 6)
    whole = logical_values(7, "w", shape)
    part = box_values(7, "w", shape, ((1, 3), (2, 5)))
    assert torch.equal(whole[1:3, 2:5], part)
    assert not torch.equal(logical_values(7, "w", shape), logical_values(7, "v", shape))
    assert not torch.equal(logical_values(7, "w", shape), logical_values(8, "w", shape))
    assert bool((whole.abs() < 1).all()) and bool((whole != 0).all())


def test_the_short_cut_for_indices_below_2_32_gives_the_same_bits():
    """Replay blobs and every recorded figure depend on these exact values."""
    for start in (0, 12345, 2**32 - 4096):
        indices = torch.arange(start, start + 4096, dtype=torch.int64)
        for key in (0, 1, 0xDEADBEEF, 2**32 - 1):
            full = uniform_from_indices(key, indices)
            short = uniform_from_indices(key, indices, below_2_32=True)
            assert torch.equal(full.view(torch.int64), short.view(torch.int64))
    beyond = torch.tensor([2**32, 2**33 + 5])  # where the high word counts: the full hash differs
    assert not torch.equal(uniform_from_indices(9, beyond), uniform_from_indices(9, beyond, below_2_32=True))
    whole = box_values(7, "w", (3, 5), full_box((3, 5)))  # takes the short cut
    assert torch.equal(whole.flatten(), uniform_from_indices(stream_key(7, "w"), torch.arange(15)))


def test_logical_grad_is_the_union_of_local_slices():
    layout = adapter_layout(ep_size=4, ep_fsdp=2, experts=8, hybrid_shared=True)
    injection = Injection(seed=1, dtype="bf16")
    for spec in layout.trainable:
        full = logical_grad(layout, injection, spec)
        for r in range(8):
            box = layout.local_box(spec, r)
            local = local_grad(layout, injection, spec, r)
            assert torch.equal(full[tuple(slice(a, b) for a, b in box)], local.to(torch.float64))


def test_no_grad_expands_to_every_replica_and_zeroes_the_logical_slice():
    layout = autoep_layout(world_size=4, ep_size=2, owner_of=[0, 0, 1, 1])
    name = "moe.experts.3.weight"
    spec = layout.param(name)
    injection = Injection(none_on={name: {1}})  # rank 1 alone is named; rank 3 holds the same expert
    assert [local_grad(layout, injection, spec, r) is None for r in range(4)] == [True, True, True, True]
    assert torch.count_nonzero(logical_grad(layout, injection, spec)) == 0
    other = layout.param("moe.experts.0.weight")
    assert local_grad(layout, injection, other, 0) is not None


def test_nonfinite_lands_on_every_holder_of_that_element_only():
    layout = Layout(MeshSpec.of(dp=2), (param("w", (4, 3), dp=Shard(0)), param("v", (3,))))
    injection = Injection(nonfinite=[("w", 7, "nan"), ("v", 1, "-inf")])
    w0, w1 = (local_grad(layout, injection, layout.param("w"), r) for r in range(2))
    assert math.isnan(float(w1[0, 1])) and bool(torch.isfinite(w0).all())
    v0, v1 = (local_grad(layout, injection, layout.param("v"), r) for r in range(2))
    assert float(v0[1]) == -math.inf and torch.equal(bit_words(v0), bit_words(v1))
    assert math.isnan(constructive_norm(layout, injection, 2.0))
    assert math.isnan(constructive_norm(layout, injection, math.inf))


def test_zero_and_scale():
    layout = Layout(MeshSpec.of(dp=1), (param("a", (5,)), param("b", (5,))))
    base = constructive_norm(layout, Injection(dtype="fp64"), 2.0)
    scaled = constructive_norm(layout, Injection(dtype="fp64", scale=3.0), 2.0)
    assert scaled == pytest.approx(3 * base, rel=1e-12)
    only_b = constructive_norm(layout, Injection(dtype="fp64", zero={"a"}), 2.0)
    b = logical_values(0, "b", (5,)) * magnitude(0, "b")
    assert only_b == pytest.approx(float(b.norm()), rel=1e-12)


def test_magnitudes_differ_between_parameters():
    sizes = {magnitude(0, f"experts.{i}.weight") for i in range(8)}
    assert len(sizes) == 8 and all(0.25 <= m < 4 for m in sizes)


def test_injection_validation():
    layout = Layout(MeshSpec.of(dp=2), (param("w", (4,)), param("frozen", (4,), trainable=False)))
    with pytest.raises(LayoutError, match="not a trainable parameter"):
        Injection(zero={"frozen"}).validate(layout)
    with pytest.raises(LayoutError, match="outside a tensor"):
        Injection(nonfinite=[("w", 4, "nan")]).validate(layout)
    with pytest.raises(LayoutError, match="outside the mesh"):
        Injection(none_on={"w": {5}}).validate(layout)
    with pytest.raises(LayoutError, match="unknown dtype"):
        Injection(dtype="fp8")


def test_full_box_covers_shape():
    assert full_box((2, 3)) == ((0, 2), (0, 3))


@pytest.mark.parametrize("shape", [(3, 4), (2, 3, 5), (300, 300)])  # kept patterns, and one too large to keep
def test_parameter_values_are_a_fresh_tensor_each_time(shape):
    """A target that scales its parameters writes into the tensor it was given: the next model built
    with the same shape must still get the pattern (1, 1.125, ..., 1.875), not the scaled values."""
    from harness.cases.model import parameter_values

    first = parameter_values(shape, torch.float32, torch.device("cpu"))
    first.mul_(3.0)
    again = parameter_values(shape, torch.float32, torch.device("cpu"))
    expected = 1 + (torch.arange(math.prod(shape)) % 8).reshape(shape) / 8
    assert again.data_ptr() != first.data_ptr()
    assert torch.equal(again, expected)
