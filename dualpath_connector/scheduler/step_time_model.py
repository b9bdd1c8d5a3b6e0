"""A step-time model: predicted seconds of one engine step from what the step computes.

The paper (DualPath §6.2) predicts a step's attention time from each scheduled request's
``(cached, bsz)`` pair and fits the relation to wall-clock time by profiling. Here a step is
described by four features, and its time is their dot product with non-negative coefficients:

- ``1``: the fixed cost of a step (launch, sampling, Python);
- prefill tokens: the linear part of a prefill (projections, MLP), per new token;
- decode tokens: the same for tokens of requests past their prompt;
- attention work: ``sum(new * (context + new / 2))`` over every scheduled request, the
  number of query-key pairs causal attention computes for ``new`` tokens after ``context``
  tokens already in the KV cache.

The coefficients are fitted by least squares from measured steps (non-negative: a step never
gets cheaper by computing more, which also keeps the prediction monotone for the binary search).
"""

from __future__ import annotations

import json
import math
import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FEATURES = ("step", "prefill_tokens", "decode_tokens", "attention_work")
PROFILE_FORMAT = "dualpath-kv step-time model 1"


def attention_work(context: int, new_tokens: int) -> float:
    """Query-key pairs of ``new_tokens`` causal queries after ``context`` cached tokens."""
    return new_tokens * (context + new_tokens / 2.0)


@dataclass
class StepShape:
    """What one step computes, summed over its scheduled requests."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    attention_work: float = 0.0

    def add(self, context: int, new_tokens: int, decode: bool) -> None:
        if decode:
            self.decode_tokens += new_tokens
        else:
            self.prefill_tokens += new_tokens
        self.attention_work += attention_work(context, new_tokens)

    def with_prefill(self, context: int, new_tokens: int) -> StepShape:
        """This step plus a prefill chunk of ``new_tokens`` after ``context`` (self unchanged)."""
        return StepShape(
            self.prefill_tokens + new_tokens,
            self.decode_tokens,
            self.attention_work + attention_work(context, new_tokens),
        )

    def vector(self) -> np.ndarray:
        return np.array([1.0, self.prefill_tokens, self.decode_tokens, self.attention_work])


class StepTimeModel:
    """Non-negative linear step-time model; fitted from measured steps, saved as a profile."""

    def __init__(self, coefficients: np.ndarray | list[float] | None = None) -> None:
        self.coefficients = None if coefficients is None else _checked(coefficients)

    @property
    def fitted(self) -> bool:
        return self.coefficients is not None

    def predict(self, shape: StepShape) -> float:
        """Predicted seconds of a step of ``shape``; raises if the model has no coefficients."""
        if self.coefficients is None:
            raise RuntimeError("the step-time model is not fitted yet")
        return float(self.coefficients @ shape.vector())

    def fit(self, shapes: list[StepShape], seconds: list[float]) -> None:
        """Least-squares fit with non-negative coefficients (active set: drop negative terms, refit)."""
        if len(shapes) != len(seconds) or len(shapes) < len(FEATURES):
            raise ValueError(f"need at least {len(FEATURES)} measured steps, got {len(shapes)}")
        x = np.stack([s.vector() for s in shapes])
        y = np.asarray(seconds, dtype=float)
        # Columns scaled to unit norm so attention work (~1e6) and the step term (1) condition alike.
        scale = np.linalg.norm(x, axis=0)
        scale[scale == 0] = 1.0
        xs = x / scale
        active = [i for i in range(len(FEATURES)) if np.any(x[:, i] != 0)]
        solution = np.zeros(len(FEATURES))
        while active:
            sub, *_ = np.linalg.lstsq(xs[:, active], y, rcond=None)
            if np.all(sub >= 0):
                solution[active] = sub
                break
            active = [i for i, c in zip(active, sub) if c > 0]
        self.coefficients = solution / scale

    def to_profile(self) -> dict:
        if self.coefficients is None:
            raise RuntimeError("the step-time model is not fitted yet")
        return {"format": PROFILE_FORMAT, "features": list(FEATURES),
                "coefficients": [float(c) for c in self.coefficients]}

    @classmethod
    def from_profile(cls, profile: object) -> StepTimeModel:
        """A model from a saved profile; ValueError names what is wrong with it."""
        if not isinstance(profile, dict) or profile.get("format") != PROFILE_FORMAT:
            raise ValueError(f"not a profile of format {PROFILE_FORMAT!r}")
        if profile.get("features") != list(FEATURES):
            raise ValueError(f"features must be {list(FEATURES)}")
        return cls(profile.get("coefficients"))

    def save(self, path: Path) -> None:
        """Write the profile atomically (a crash mid-write leaves the previous file)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_profile(), indent=1))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> StepTimeModel:
        try:
            profile = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {path}: {exc}") from None
        return cls.from_profile(profile)


class StepRecorder:
    """The last ``window`` measured steps, refitting ``model`` every ``refit_every`` new ones."""

    def __init__(self, model: StepTimeModel, window: int, min_steps: int, refit_every: int) -> None:
        self.model = model
        self.min_steps = min_steps
        self.refit_every = refit_every
        self.shapes: deque[StepShape] = deque(maxlen=window)
        self.seconds: deque[float] = deque(maxlen=window)
        self.recorded = 0

    def record(self, shape: StepShape, seconds: float) -> bool:
        """Add a measured step; True when the model was refitted."""
        self.shapes.append(shape)
        self.seconds.append(seconds)
        self.recorded += 1
        if len(self.shapes) < self.min_steps or self.recorded % self.refit_every:
            return False
        self.model.fit(list(self.shapes), list(self.seconds))
        return True


def _checked(coefficients: object) -> np.ndarray:
    if not isinstance(coefficients, (list, tuple, np.ndarray)) or len(coefficients) != len(FEATURES):
        raise ValueError(f"coefficients must be {len(FEATURES)} numbers ({', '.join(FEATURES)})")
    values = []
    for c in coefficients:
        if isinstance(c, bool) or not isinstance(c, (int, float, np.floating)) or not math.isfinite(c) or c < 0:
            raise ValueError(f"coefficients must be finite and >= 0, got {c!r}")
        values.append(float(c))
    return np.array(values)
