"""The Hugging Face stack that several framework folders import (accelerate, torchtune, VeOmni,
ColossalAI, NeMo Automodel), pinned once.

``.ci/install-frameworks`` installs every folder's recipe into one environment with ``--no-deps``, so
a package two recipes both pin must be pinned to the same version or the later recipe silently
replaces what the earlier one was tested with. These versions import and run every adapter here:
VeOmni 0.1.12 and NeMo Automodel 0.7.0 need transformers 5, which needs huggingface-hub 2 (its
HTTP client comes as httpx2/httpcore2) and tokenizers 0.23; ColossalAI's peft and torchtune's
datasets import next to them. None of it touches torch.
"""

HF_STACK = ("transformers==5.18.0 huggingface-hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 regex==2026.11.15 "
            "httpx2==2.16.2 httpcore2==2.16.2 anyio==4.16.0 h11==0.16.0 idna==3.20 truststore==0.10.5 "
            "numpy==2.4.6 pyyaml==6.0.4 tqdm==4.70.1 packaging==26.4 psutil==7.2.2 requests==2.34.2 urllib3==2.8.0 "
            "certifi==2026.10.19.post1 charset_normalizer==3.5.3")
"""One ``pip install --no-deps`` argument list."""
