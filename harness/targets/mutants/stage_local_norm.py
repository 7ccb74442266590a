"""Stage-local norm: no reduction over ``pp``, so each pipeline stage clips with its own norm.

torch's ``clip_grad_norm_`` reduces over the DTensor meshes only, never over pipeline stages
(torchtitan #596, fixed by PR #649 with ``pp_mesh``): every stage reports and applies a different,
too small norm (1/sqrt(pp) when the stages weigh the same).
"""

from harness.cases.axes import MeshAxis

from ._shapes import missing_reduction

clip = missing_reduction(MeshAxis.PP)
