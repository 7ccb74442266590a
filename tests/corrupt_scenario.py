"""A scenario whose injection breaks its own promise: rank 1's gradient differs from what the
layout and the generator say it is. The measured truth (from the bits) then disagrees with the
constructive truth (from the generator), and the harness must call that a harness error, not blame
the clip function."""

from harness.clipmath import local_tensor
import harness.targets.builtin_scenarios  # noqa: F401  (maps harness.scenarios in a checkout)
from harness.scenarios.dense_dp import DenseDP


class CorruptedInjection(DenseDP):
    name = "corrupted_injection"

    def inject(self, model, variant, rank):
        super().inject(model, variant, rank)
        if rank == 1:
            local_tensor(model.get_parameter("layers.0.bias").grad).view(-1)[0] += 1.0
