"""Mean-field Gaussian posteriors over plain ``nn.Module`` s: functional weight sampling, vectorised
Monte Carlo gradients (Bayes by Backprop, MESU paper Eq. 1), MC-averaged and MAP predictions, and the
expected curvature under the posterior (MESU Lemma 1 / Eq. 4)."""

from curvkit.posterior.curvature import expected_ggn_diagonal
from curvkit.posterior.predict import predict_map, predict_mc
from curvkit.posterior.sampling import (
    LossFn,
    MCGradients,
    likelihood_loss,
    mc_gradients,
    mc_gradients_loop,
    sample_eps,
    sample_weights,
)

__all__ = [
    "LossFn",
    "MCGradients",
    "expected_ggn_diagonal",
    "likelihood_loss",
    "mc_gradients",
    "mc_gradients_loop",
    "predict_map",
    "predict_mc",
    "sample_eps",
    "sample_weights",
]
