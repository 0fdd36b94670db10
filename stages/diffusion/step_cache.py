"""Step caching for the denoise loop: when to reuse a step instead of computing it (policy only).

Approximate by design (DESIGN §5): a skipped step reuses what an earlier step computed, so the
output drifts from the uncached one. A request opts in (`step_cache`), a model allows it
(`ModelSpec.step_cache`), and threshold 0 (or interval 1) computes every step, bit for bit.

Methods, each with its own state per request and CFG branch (uncond and cond drift apart):
* `teacache` (Liu et al. 2024): the relative L1 change of the timestep-modulated input of the
  first block, rescaled by a polynomial fitted per model family, is summed across steps; a step
  is skipped while the sum stays below the threshold, and the sum restarts at each computed step.
* `fbcache` (first-block cache, ParaAttention): the first block always runs; when its residual
  changed less than the threshold (relative L1) since the last computed step, the other blocks
  are skipped.
* `interval`: compute every `interval`-th step (the baseline the other two must beat).
The first and last steps are always computed. The execution lives in stages/diffusion/block_stack.py.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

from stages.events import ErrorKind, StageError

METHODS = ("teacache", "fbcache", "interval")
MAX_THRESHOLD = 10.0  # a larger threshold skips every inner step; refuse it as a typo
MAX_INTERVAL = 1000

# TeaCache's published rescale polynomials (numpy.poly1d order, highest power first), keyed by the
# indicator a family computes. Families without one use IDENTITY (the raw relative change).
IDENTITY = (1.0, 0.0)
TEACACHE_COEFFICIENTS = {
    # TeaCache4FLUX (FLUX.1-dev): rel. L1 of blocks[0].norm1(x, temb)
    "flux": (4.98651651e+02, -2.83781631e+02, 5.58554382e+01, -3.82021401e+00, 2.64230861e-01),
    # TeaCache4LTX-Video: rel. L1 of norm1(x) * (1 + scale_msa) + shift_msa of block 0
    "ltx": (2.14700694e+01, -1.28016453e+01, 2.31279151e+00, 7.92487521e-01, 9.69274326e-03),
    # TeaCache4Wan2.1 "ret steps" mode: rel. L1 of the timestep projection e0 (the blocks' temb)
    "wan-1.3b": (-5.21862437e+04, 9.23041404e+03, -5.28275948e+02, 1.36987616e+01, -4.99875664e-02),
    "wan-14b": (-3.03318725e+05, 4.90537029e+04, -2.65530556e+03, 5.87365115e+01, -3.15583525e-01),
}


@dataclass(frozen=True)
class StepCacheConfig:
    """Per model (ModelSpec.step_cache): whether requests may ask for step caching."""

    enabled: bool = False  # requests with `step_cache` are refused unless the model allows it
    teacache_coefficients: tuple[float, ...] | None = None  # None: the family's published polynomial

    def __post_init__(self):
        if self.teacache_coefficients is not None and len(self.teacache_coefficients) < 1:
            raise ValueError("step_cache.teacache_coefficients must hold at least one coefficient")


@dataclass(frozen=True)
class StepCacheParams:
    """A request's choice: method and how aggressive it is."""

    method: str  # one of METHODS
    threshold: float = 0.0  # teacache / fbcache: 0 computes every step
    interval: int = 1  # interval: compute every interval-th step; 1 computes every step

    @classmethod
    def parse(cls, value: Any) -> "StepCacheParams | None":
        """A request's `step_cache` (None, a dict or params) -> params. Errors name the field."""
        if value is None or isinstance(value, StepCacheParams):
            return value
        if not isinstance(value, Mapping):
            raise _bad("step_cache", 'step_cache must be an object such as {"method": "teacache", "threshold": 0.1}')
        unknown = sorted(set(value) - {"method", "threshold", "interval"})
        if unknown:
            raise _bad(f"step_cache.{unknown[0]}", f"step_cache has no field {unknown[0]!r}; "
                                                   "fields: method, threshold, interval")
        method = value.get("method")
        if method not in METHODS:
            raise _bad("step_cache.method", f"step_cache.method must be one of {list(METHODS)}; got {method!r}")
        threshold = value.get("threshold", 0.0)
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) \
                or not 0 <= threshold <= MAX_THRESHOLD:
            raise _bad("step_cache.threshold", f"step_cache.threshold must be a number in [0, {MAX_THRESHOLD}]; "
                                               f"got {threshold!r}")
        interval = value.get("interval", 1)
        if isinstance(interval, bool) or not isinstance(interval, int) or not 1 <= interval <= MAX_INTERVAL:
            raise _bad("step_cache.interval", f"step_cache.interval must be an integer in [1, {MAX_INTERVAL}]; "
                                              f"got {interval!r}")
        if method == "interval" and "threshold" in value:
            raise _bad("step_cache.threshold", "step_cache.threshold applies to teacache and fbcache; "
                                               "the interval method takes `interval`")
        if method != "interval" and "interval" in value:
            raise _bad("step_cache.interval", f"step_cache.interval applies to the interval method, not {method}")
        return cls(method, float(threshold), interval)


@dataclass
class BranchCache:
    """One CFG branch of one request: what its next decision compares against."""

    reference: Any = None  # teacache: last step's indicator; fbcache: first-block residual of the last computed step
    accumulated: float = 0.0  # teacache: rescaled change summed since the last computed step
    residual: Any = None  # what a skipped step reuses: the stack's residual (or the model output)
    stack: str | None = None  # the block stack that produced `residual` (Wan 2.2 switches transformers)


@dataclass
class StepCacheState:
    """A request's step cache (lives on its WorkItem): one BranchCache per CFG branch."""

    params: StepCacheParams
    branches: list[BranchCache]
    computed: int = 0  # branch-steps run through every block
    skipped: int = 0  # branch-steps that reused the cached residual
    key: str = field(default_factory=lambda: uuid.uuid4().hex)  # names it where another rank keeps a branch

    @classmethod
    def new(cls, params: StepCacheParams, num_branches: int) -> "StepCacheState":
        return cls(params, [BranchCache() for _ in range(num_branches)])


def rescale(coefficients: tuple[float, ...], x: float) -> float:
    """The polynomial at x (Horner), clamped at 0: a fit can dip below zero outside the range it was
    fitted on, and a negative change would make every later step a skip."""
    y = 0.0
    for c in coefficients:
        y = y * x + c
    return max(y, 0.0)


def must_compute(state: StepCacheState, branch: BranchCache, step: int, total: int, stack: str,
                 first_steps: int = 1) -> bool:
    """Steps no method may skip: the first `first_steps`, the last, and any without a usable residual."""
    return step < first_steps or step >= total - 1 or branch.residual is None or branch.stack != stack


def decide_teacache(state: StepCacheState, branch: BranchCache, distance: float | None, coefficients: tuple[float, ...],
                    forced: bool) -> bool:
    """True: compute. `distance` is the relative L1 change of the indicator since the previous step."""
    if forced or distance is None:
        branch.accumulated = 0.0
        return True
    branch.accumulated += rescale(coefficients, distance)
    if branch.accumulated < state.params.threshold:
        return False
    branch.accumulated = 0.0
    return True


def decide_fbcache(state: StepCacheState, distance: float | None, forced: bool) -> bool:
    """True: compute. `distance` compares the first block's residual with the last computed step's."""
    return forced or distance is None or not distance < state.params.threshold


def decide_interval(state: StepCacheState, step: int, forced: bool) -> bool:
    return forced or step % state.params.interval == 0


def _bad(param: str, message: str) -> StageError:
    return StageError("invalid_value", message, param=param, kind=ErrorKind.INVALID)
