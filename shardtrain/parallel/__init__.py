"""Parallel layouts applied to the plain model by `parallelize`."""
