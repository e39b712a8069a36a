"""curvkit: the curvature of neural networks and the methods built on it.

Layers (imports point downward): data/models/likelihoods -> linalg -> curvature -> optim/posterior ->
continual/slt -> experiments -> cli. See docs/architecture.md.
"""

__version__ = "0.1.0"
