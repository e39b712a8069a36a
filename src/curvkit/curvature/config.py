"""One configuration of the Kronecker curvature statistics, shared by every entry point that gathers them.

:class:`CurvatureConfig` holds the options that say WHICH Kronecker statistics are gathered, whatever consumes
them: :class:`~curvkit.curvature.estimators.KroneckerEstimator` and the one-shot functions (``kfac``,
``kflr``, ...), :class:`~curvkit.curvature.ekfac.EKFACEstimator`, the Gauss-Newton optimiser
(:class:`~curvkit.optim.second_order.gauss_newton.GaussNewton`), Kronecker Laplace
(:class:`~curvkit.laplace.Laplace`) and the continual Kronecker Laplace penalty
(:class:`~curvkit.continual.laplace.LaplacePenalty`). Each option has one name and one default here; the
entry points take the same keyword arguments with the same defaults (``tests/test_vocabulary.py`` reads their
signatures), build the configuration from them (it validates once, in :meth:`CurvatureConfig.__post_init__`)
and hand it to the estimator (``KroneckerEstimator(..., config=cfg)``).

Options (docs/architecture.md has the definitions):

* ``weight_sharing``: ``'expand'`` (default) | ``'reduce'``: how the R positions that share a weight (tokens,
  patches, convolution locations) enter the factors.
* ``norm_structure``: ``'full'`` (default: the exact per-layer block of a normalisation layer's weight and
  bias from per-sample gradients, 2D x 2D) | ``'diag'`` (its diagonal). One default everywhere, so a Kronecker
  Laplace precision is ``N x`` the estimator's per-datum curvature plus the prior (before curvkit 0.3 Laplace
  defaulted to ``'diag'``).
* ``parameter_structure``: ``'diag'`` (default) | ``'full'``: the block of a raw (1, ...) parameter (a ViT's
  class token and position table).
* ``batch_statistics``: ``'refuse'`` (default) | ``'couple'``: BatchNorm in training mode (factors of the
  coupled backward pass; an approximation beyond the per-sample case).
* ``output_factor``: ``'auto'`` (default) | ``'dense'`` | ``'low_rank'``: how an output factor is held.
* ``mc_samples``: sampled labels (``kfac``, ``mc_fisher``) or projections (``projection``) per datum (1).
* ``distribution``: ``'rademacher'`` (default) | ``'gaussian'``: the projection vectors.

The curvature SOURCE (``kfac``, ``kflr``, ...) and the STRUCTURE (``kron``, ``diag``, ``full``) are arguments
of the entry points, not of this configuration: their defaults depend on what the entry point is for (the
estimator's Monte Carlo ``kfac``, Gauss-Newton's ``'auto'``, Laplace's exact ``kflr``). The source has one name
everywhere, ``curvature`` (the estimators' former ``method=`` is deprecated: :func:`renamed_method`).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Literal

from curvkit.validation import integer

__all__ = ["CurvatureConfig", "renamed_method", "renamed_option", "resolve_config"]

WeightSharing = Literal["expand", "reduce"]
BlockStructure = Literal["full", "diag"]
NormStructure = BlockStructure  # the former name
BatchStatistics = Literal["refuse", "couple"]
OutputFactor = Literal["auto", "dense", "low_rank"]
Distribution = Literal["rademacher", "gaussian"]

_CHOICES: dict[str, tuple[str, ...]] = {
    "weight_sharing": ("expand", "reduce"),
    "norm_structure": ("full", "diag"),
    "parameter_structure": ("diag", "full"),
    "batch_statistics": ("refuse", "couple"),
    "output_factor": ("auto", "dense", "low_rank"),
    "distribution": ("rademacher", "gaussian"),
}


@dataclass(frozen=True)
class CurvatureConfig:
    """The Kronecker statistics' options (module docstring), validated once on construction."""

    weight_sharing: WeightSharing = "expand"
    norm_structure: BlockStructure = "full"
    parameter_structure: BlockStructure = "diag"
    batch_statistics: BatchStatistics = "refuse"
    output_factor: OutputFactor = "auto"
    mc_samples: int = 1
    distribution: Distribution = "rademacher"

    def __post_init__(self) -> None:
        for name, allowed in _CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        object.__setattr__(self, "mc_samples", integer("mc_samples", self.mc_samples))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The option names, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """{option name: default}."""
        return {f.name: f.default for f in dataclasses.fields(cls)}

    def replace(self, **changes: Any) -> CurvatureConfig:
        """A copy with ``changes`` (validated)."""
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def resolve_config(config: CurvatureConfig | None, given: dict[str, Any], what: str) -> CurvatureConfig:
    """The :class:`CurvatureConfig` of an entry point: ``config`` when given (then every keyword option in
    ``given`` must be at its default or equal to the config's: two different values would be a guess), else
    the configuration of the keyword options (validated there)."""
    if config is None:
        return CurvatureConfig(**given)
    if not isinstance(config, CurvatureConfig):
        raise TypeError(f"{what}: config must be a curvkit.curvature.CurvatureConfig, got {type(config).__name__}")
    defaults = CurvatureConfig.defaults()
    clash = [f"{k}={v!r}" for k, v in given.items() if v != defaults[k] and v != getattr(config, k)]
    if clash:
        raise ValueError(f"{what}: {', '.join(clash)} differ from config={config}; pass the options either as "
                         "keywords or in config")
    return config


def renamed_option(value: Any, old: Any, who: str, name: str, old_name: str, default: Any) -> Any:
    """An option under its one name (``name``); its former keyword ``old_name`` still works for one release with a
    ``DeprecationWarning`` (given beside a different, non-default ``value``: an error)."""
    if old is None:
        return value
    warnings.warn(f"{who}({old_name}=...) is renamed {name}=...; the old name goes in the next release",
                  DeprecationWarning, stacklevel=4)
    if value != default and value != old:
        raise ValueError(f"{who}: {name}={value!r} and {old_name}={old!r} name one option; pass {name} only")
    return old


def renamed_method(curvature: Any, method: Any, who: str, default: Any) -> Any:
    """The curvature source of an estimator, named ``curvature`` as in GaussNewton and Laplace; the former
    keyword ``method=`` still works for one release (:func:`renamed_option`). Positional calls
    (``KroneckerEstimator(model, likelihood, "kflr")``) are unchanged."""
    return renamed_option(curvature, method, who, "curvature", "method", default)
