"""Second-order optimisation with Kronecker-factored Gauss-Newton curvature (thesis chapter 4).

* :class:`GaussNewton` - the damped Gauss-Newton optimiser (KFRA/KFLR/KFAC/random-projection directions,
  factored or exact damped inversion, exact-GGN step size, Levenberg-Marquardt tau, greedy zeta);
  :data:`FAST_ADAPTATION` a faster damping schedule than the thesis's; :data:`AMORTISED` refreshes at
  their own intervals (factors, inverses, quadratic model).
* :mod:`.quadratic` - the quadratic model and the damping rules as plain functions.
* :mod:`.linearisation` - Jacobian-vector products and the exact minibatch GGN in output space.
"""

from curvkit.optim.second_order.gauss_newton import (
    AMORTISED,
    FAST_ADAPTATION,
    KFLR_MAX_EXTRA_PASSES,
    GaussNewton,
    default_curvature,
)

__all__ = ["AMORTISED", "FAST_ADAPTATION", "KFLR_MAX_EXTRA_PASSES", "GaussNewton", "default_curvature"]
