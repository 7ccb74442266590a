"""megatron-core (pinned, without its training-stack dependencies)."""

from harness.cases.frameworks import Framework


RELEASES = ("0.16.1", "0.19.2")
"""megatron-core releases the adapter runs with here (CPU, gloo, Python 3.11), oldest first: the pin and
the newest. 0.16.1 is the newest release whose Requires-Python admits 3.11 (0.17.0 on need >= 3.12).
0.19.2 runs on 3.11 all the same, installed past that check, and its import needs triton, which it
does not declare (``megatron.core.transformer.moe.ops.paged_stash`` imports it); in a scratch venv that
sees the project's packages (ARCHITECTURE.md, "scratch venvs"):

    pip install --no-deps --ignore-requires-python megatron-core==0.19.2
    pip install --no-deps triton==3.7.1

What differs: 0.16.1 cannot build the ``experts grouped GEMM (TE)`` variant here (its marks live in
``TEGroupedLinear.__init__``, Transformer Engine only: SKIP); 0.19.2 marks them with
``_set_expert_parameter_attributes`` (Megatron-LM PR #5916) and every case passes."""

FRAMEWORK = Framework(
    "megatron-core", "megatron.core.optimizer.clip_grads", "megatron-core",
    "pip install --no-deps megatron-core==0.16.1",
    recipe=("pip install --no-deps megatron-core==0.16.1",),
    releases=RELEASES,
    release_recipes={"0.19.2": ("pip install --no-deps --ignore-requires-python megatron-core==0.19.2",
                                "pip install --no-deps triton==3.7.1")})
