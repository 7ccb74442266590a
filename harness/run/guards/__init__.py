"""Keeping a bad target contained: hangs, threads and processes it leaves, processes whose parent died."""
