"""A correct clip (the reference) that first checks the rank computes with the intra-op threads the test
expects (``CLIPCHECK_TEST_THREADS``): a launcher must hand every rank the count ``OMP_NUM_THREADS``
asks for, or the documented default (``harness.run.world.openmp.rank_threads``)."""

import os

import torch

from harness.reference import clip_grad_norm


def clip(model, *, max_norm, norm_type):
    want = int(os.environ["CLIPCHECK_TEST_THREADS"])
    if torch.get_num_threads() != want:
        raise RuntimeError(f"this rank computes with {torch.get_num_threads()} threads, expected {want} "
                           f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')!r})")
    return clip_grad_norm(model, max_norm=max_norm, norm_type=norm_type)
