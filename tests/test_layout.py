"""The layout model: mesh arithmetic, local slices, replica counts, and validation errors."""

import pytest

from harness.cases.layout import Layout, LayoutError, MeshSpec, Replicate, Shard, param
from harness.cases.scenario import ep_sizes_for
import harness.targets.builtin_scenarios  # noqa: F401  (maps harness.scenarios in a checkout)
from harness.scenarios.deepspeed.scenario import autoep_layout
from harness.scenarios.xorl.scenario import adapter_layout, apply_ep_plan, EP_PLANS, PREFIX


def test_mesh_coordinates_are_row_major_like_device_mesh():
    mesh = MeshSpec.of(ep=2, ep_fsdp=2)
    assert [mesh.coordinate(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert mesh.groups("ep") == [[0, 2], [1, 3]]
    assert mesh.groups("ep_fsdp") == [[0, 1], [2, 3]]
    assert all(mesh.rank_at(mesh.coordinate(r)) == r for r in range(4))
    assert mesh.ranks_where(ep=1) == {2, 3}


def test_mesh_product_must_equal_world():
    with pytest.raises(LayoutError, match="needs 6 ranks, but the world has 4"):
        MeshSpec.of(ep=3, ep_fsdp=2).check_world(4)


@pytest.mark.parametrize("bad", [0, -1])
def test_mesh_sizes_must_be_positive(bad):
    with pytest.raises(LayoutError, match="positive integer size"):
        MeshSpec.of(ep=bad)


def test_duplicate_mesh_dims_rejected():
    with pytest.raises(LayoutError, match="unique"):
        MeshSpec((("ep", 2), ("ep", 2)))


def test_shard_dim_out_of_range():
    with pytest.raises(LayoutError, match=r"Shard\(3\) on mesh axis 'ep' is out of range"):
        Layout(MeshSpec.of(ep=2), (param("w", (4, 4, 4), ep=Shard(3)),))


def test_experts_not_divisible_by_ep_size():
    with pytest.raises(LayoutError, match="6 elements .* not divisible by mesh axis 'ep' of size 4"):
        Layout(MeshSpec.of(ep=4), (param("experts.w", (6, 8), ep=Shard(0)),))


def test_nested_shardings_divide_what_the_outer_one_left():
    # 8 experts over ep=2 leaves 4, which ep_fsdp=8 cannot split
    with pytest.raises(LayoutError, match="after outer shardings"):
        Layout(MeshSpec.of(ep=2, ep_fsdp=8), (param("w", (8, 3), ep=Shard(0), ep_fsdp=Shard(0)),))


def test_unknown_mesh_dim_in_placement():
    with pytest.raises(LayoutError, match="mesh axis 'tp', which the mesh does not have"):
        Layout(MeshSpec.of(dp=2), (param("w", (4,), tp=Shard(0)),))


def test_present_ranks_must_cover_every_slice():
    mesh = MeshSpec.of(ep=2)
    with pytest.raises(LayoutError, match="leave 1 of its 2 slices on no rank"):
        Layout(mesh, (param("w", (4,), ep=Shard(0), present_ranks={0}),))


def test_local_boxes_nest_in_mesh_order():
    mesh = MeshSpec.of(ep=2, ep_fsdp=2)
    layout = Layout(mesh, (param("w", (8, 6), ep=Shard(0), ep_fsdp=Shard(0)),))
    spec = layout.param("w")
    assert [layout.local_box(spec, r) for r in range(4)] == [
        ((0, 2), (0, 6)), ((2, 4), (0, 6)), ((4, 6), (0, 6)), ((6, 8), (0, 6)),
    ]


def test_replica_counts_follow_replicated_dims_and_presence():
    layout = adapter_layout(ep_size=2, ep_fsdp=2, experts=8, hybrid_shared=True)
    shared = layout.param(PREFIX + "gate_proj_lora_A")   # [1, H, r]: Replicate on ep, Shard(1) on ep_fsdp
    per_expert = layout.param(PREFIX + "gate_proj_lora_B")
    assert [layout.replica_count(shared, r) for r in range(4)] == [2, 2, 2, 2]
    assert [layout.replica_count(per_expert, r) for r in range(4)] == [1, 1, 1, 1]

    uneven = autoep_layout(world_size=2, ep_size=2, owner_of=[0, 0, 0, 0])
    expert = uneven.param("moe.experts.0.weight")
    assert uneven.local_box(expert, 1) is None
    assert uneven.replica_count(expert, 0) == 1
    assert uneven.replica_count(uneven.param("dense.weight"), 1) == 2


def test_declared_plan_fallback_and_shared_factor_rule():
    layout = adapter_layout(ep_size=4, ep_fsdp=1, experts=8, hybrid_shared=True)
    complete = apply_ep_plan(layout, EP_PLANS["qwen3_moe"])
    omitted = apply_ep_plan(layout, EP_PLANS["minimax_m3"])
    assert complete[PREFIX + "gate_proj_lora_B"]["ep"] == Shard(0)
    assert complete[PREFIX + "gate_proj_lora_A"]["ep"] == Replicate()  # shared, local leading dim 1
    assert omitted[PREFIX + "gate_proj_lora_B"]["ep"] == Replicate()  # fallback
    assert omitted[PREFIX + "gate_up_proj"]["ep"] == Shard(0)
    one_local = adapter_layout(ep_size=4, ep_fsdp=1, experts=4, hybrid_shared=False)
    assert apply_ep_plan(one_local, EP_PLANS["qwen3_moe"])[PREFIX + "gate_proj_lora_B"]["ep"] == Replicate()


def test_ep_sizes_validation_messages():
    assert ep_sizes_for("s", 4, 8, None) == [1, 2, 4]
    assert ep_sizes_for("s", 6, 8, None) == [1, 2]
    with pytest.raises(LayoutError, match="ep_size 3 does not divide the world size 4"):
        ep_sizes_for("s", 4, 8, (3,))
    with pytest.raises(LayoutError, match="8 experts are not divisible by ep_size 3"):
        ep_sizes_for("s", 6, 8, (3,))


def test_a_variants_info_is_read_back_as_its_frameworks_own_type():
    """Scenario and adapter share typed objects, not string keys; the wrong kind is a clear error."""
    from dataclasses import dataclass

    from harness.cases.variant import Variant, declared_from_layout
    from harness.cases.injection import Injection

    @dataclass(frozen=True)
    class Wrapping:
        units: tuple[str, ...]

    layout = Layout(MeshSpec.of(dp=2), (param("w", (4,)),))
    variant = Variant("v", layout, Injection(seed=0), declared_from_layout(layout), info=Wrapping(("a",)))
    assert variant.info_as(Wrapping).units == ("a",)
    bare = Variant("bare", layout, Injection(seed=0), declared_from_layout(layout))
    with pytest.raises(LayoutError, match="variant 'bare' carries NoneType, not the Wrapping its target needs"):
        bare.info_as(Wrapping)
