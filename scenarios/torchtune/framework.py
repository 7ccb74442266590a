"""torchtune (pinned, with the packages its top-level import needs and nothing more).

``import torchtune`` imports its datasets, models, modules and utils packages, hence Hugging Face
``datasets`` (with pandas, pyarrow, aiohttp), ``huggingface_hub``, ``omegaconf``, the tokenizer
libraries, ``torchdata`` and ``torchao`` (``torchtune.training`` imports ``torchao.dtypes.nf4tensor``).
Every package is pinned and installed ``--no-deps``, at releases contemporary with torchtune 0.6.1
(April 2025) except the Hugging Face stack shared with the other folders
(``harness.scenarios.huggingface``: hub 2.4, with which datasets 3.5 still imports); torchao 0.10.0
imports next to torch 2.13 on CPU. The distributed recipes live in the
same wheel (the top-level ``recipes`` package), which is how the adapter can be checked against them.
"""

from ..huggingface import HF_STACK
from harness.cases.frameworks import Framework

_TORCHTUNE = "pip install --no-deps torchtune==0.6.1"
_IMPORT_DEPS = (
    "pip install --no-deps torchao==0.10.0 datasets==3.5.0 dill==0.3.8 multiprocess==0.70.16 "
    "pandas==2.2.3 python-dateutil==2.9.0.post0 six==1.17.0 pytz==2025.2 tzdata==2025.2 pyarrow==19.0.1 "
    "xxhash==3.5.0 aiohttp==3.11.16 aiosignal==1.3.2 frozenlist==1.5.0 multidict==6.4.3 yarl==1.19.0 "
    "propcache==0.3.1 attrs==25.3.0 aiohappyeyeballs==2.6.1 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 "
    "sentencepiece==0.2.0 tiktoken==0.9.0 Pillow==11.1.0 torchdata==0.11.0 " + HF_STACK
)

RELEASES = ("0.6.1",)
"""The newest release on the index is the pin; no other one was run."""

FRAMEWORK = Framework(
    "torchtune", "torchtune.training._distributed", "torchtune",
    f"{_TORCHTUNE} && {_IMPORT_DEPS} (its import needs torchao and Hugging Face datasets)",
    recipe=(_TORCHTUNE, _IMPORT_DEPS),
    releases=RELEASES)
