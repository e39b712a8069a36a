"""Reproducible experiments, one module each, registered with :mod:`curvkit.experiments.registry`."""
