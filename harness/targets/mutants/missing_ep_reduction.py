"""Missing EP reduction: partial norms are reduced over every mesh axis except ``ep``.

The expert-parallel axis is the one a dense-model clip never had (NeMo Automodel #3816, torchtitan
before EP support, ColossalAI's MoE hybrid optimizer): each EP group clips with its own norm.
"""

from harness.cases.axes import MeshAxis

from ._shapes import missing_reduction

clip = missing_reduction(MeshAxis.EP)
