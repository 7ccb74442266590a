"""NeMo Automodel (pinned; without its training-stack dependencies, which the adapter does not use).

``nemo_automodel.components.training.utils`` imports ``nemo_automodel.components.models.common``,
which imports ``transformers``; transformers 5.18 (the version Automodel 0.7.0 pins) needs
``huggingface_hub``, ``tokenizers`` and ``safetensors`` at import time (its dependency check asks
for them), and they need the rest of the second line.
Nothing here is used beyond importing: no model is downloaded or built by transformers.
"""

from ..huggingface import HF_STACK
from harness.cases.frameworks import Framework

_DEPS = ("pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0 " + HF_STACK)


RELEASES = ("0.6.0", "0.7.0")
"""The releases the adapter runs on, oldest first: 0.7.0 is the pin (and the newest); 0.6.0, installed
into a scratch venv (``pip install --no-deps nemo-automodel==0.6.0`` over this one), predates PR
#3817 and reproduces #3816 on its stock TE experts."""

FRAMEWORK = Framework(
    "nemo-automodel", "nemo_automodel.components.training.utils", "nemo-automodel",
    f"pip install --no-deps nemo-automodel==0.7.0 && pip install --no-deps {_DEPS}",
    recipe=("pip install --no-deps nemo-automodel==0.7.0", f"pip install --no-deps {_DEPS}"),
    releases=RELEASES)
