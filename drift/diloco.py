"""The DiLoCo algorithm, apart from any networking: flat parameters, pseudo-gradients, the outer
Nesterov step and the checksum every node reports.

One outer round, as a node sees it:
    delta   = theta_global - theta_local            (how far this node's copy moved)
    avg     = sum_i w_i * delta_i                    (ring all-reduce; w_i = samples_i / total)
    theta_global = NesterovOuter.step(theta_global, avg)

Invariant: every node applies the same float32 operations, in the same order, to the same
inputs, so theta_global stays bit-identical across the swarm; the checksum proves it each round.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ParamLayout:
    """Where each named parameter lives in the flat float32 vector (names sorted)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, params: dict[str, np.ndarray]) -> "ParamLayout":
        names = tuple(sorted(params))
        return cls(names, tuple(tuple(params[n].shape) for n in names))

    @property
    def size(self) -> int:
        return sum(int(np.prod(s)) for s in self.shapes)

    def flatten(self, params: dict[str, np.ndarray]) -> np.ndarray:
        if set(params) != set(self.names):
            missing = sorted(set(self.names) - set(params))
            extra = sorted(set(params) - set(self.names))
            raise ValueError(f"parameter names differ: missing {missing}, unexpected {extra}")
        out = np.empty(self.size, dtype=np.float32)
        i = 0
        for name, shape in zip(self.names, self.shapes):
            a = params[name]
            if tuple(a.shape) != shape:
                raise ValueError(f"parameter {name}: shape {tuple(a.shape)}, expected {shape}")
            n = a.size
            out[i:i + n] = a.reshape(-1)
            i += n
        return out

    def unflatten(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Views into `flat` (no copy), one per name."""
        out, i = {}, 0
        for name, shape in zip(self.names, self.shapes):
            n = int(np.prod(shape))
            out[name] = flat[i:i + n].reshape(shape)
            i += n
        return out


class NesterovOuter:
    """SGD with Nesterov momentum on the pseudo-gradient (DiLoCo: lr 0.7, momentum 0.9).

    Same update as torch.optim.SGD(nesterov=True): v = mu*v + g; theta -= lr*(g + mu*v).
    """

    def __init__(self, size: int, lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True):
        self.lr = np.float32(lr)
        self.momentum = np.float32(momentum)
        self.nesterov = nesterov
        self.velocity = np.zeros(size, dtype=np.float32)

    def step(self, theta: np.ndarray, grad: np.ndarray) -> None:
        """Update theta in place."""
        v = self.velocity
        v *= self.momentum
        v += grad
        if self.nesterov:
            update = grad + self.momentum * v
        else:
            update = v.copy()
        update *= self.lr
        theta -= update


def checksum(theta: np.ndarray, velocity: np.ndarray | None = None) -> str:
    """A short digest of the exact bytes of θ and, when given, of the outer optimizer's state: the
    swarm agrees on both each round, so a peer that hands over a poisoned velocity is caught too."""
    h = hashlib.blake2b(digest_size=12)
    for a in (theta, velocity):
        if a is not None:
            h.update(np.ascontiguousarray(a).view(np.uint8))
    return h.hexdigest()


def weighted_delta(theta_global: np.ndarray, theta_local: np.ndarray, weight: float) -> np.ndarray:
    """w_i * (theta_global - theta_local), the vector this node feeds the all-reduce. A node of
    weight 0 sends exact zeros (0 * NaN would be NaN: a node whose Δ went bad sends nothing)."""
    if weight == 0:
        return np.zeros(theta_global.shape, dtype=np.float32)
    out = np.subtract(theta_global, theta_local, dtype=np.float32)
    out *= np.float32(weight)
    return out


class DeltaCheck:
    """A node's own sanity check of its pseudo-gradient before it goes into the all-reduce: a Δ
    with NaN/Inf (an fp16 overflow on one device is enough) or one whose size per inner step is
    absurdly larger than this node's recent ones would poison θ on every node, so it is reported
    instead of sent. Size per step, because a node may train 1 step one round and 100 the next."""

    def __init__(self, factor: float = 100.0, history: int = 5):
        self.factor, self.history = factor, history
        self.recent: list[float] = []

    def problem(self, theta_global: np.ndarray, theta_local: np.ndarray, steps: int) -> str | None:
        """None if Δ is fine (and then it joins the history), else what is wrong with it."""
        norm = delta_norm(theta_global, theta_local)
        if not np.isfinite(norm):
            return "its pseudo-gradient has NaN or Inf values"
        per_step = norm / max(steps, 1)
        if len(self.recent) >= 3:
            typical = float(np.median(self.recent))
            if typical > 0 and per_step > self.factor * typical:
                return f"its pseudo-gradient is {per_step / typical:.0f}x larger per step than its recent ones"
        self.recent = (self.recent + [per_step])[-self.history:]
        return None


def epoch_order(n_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The epoch's sample order: the same permutation on every node."""
    return np.random.default_rng([seed, epoch]).permutation(n_samples)


def unit_indices(order: np.ndarray, unit, unit_samples: int) -> np.ndarray:  # noqa: ANN001 - a WorkUnit
    """The samples [unit.lo, unit.hi) of work unit `unit.id` (units tile the epoch's order)."""
    base = unit.id * unit_samples
    return order[base + unit.lo:base + min(unit.hi, unit_samples)]


def delta_norm(theta_global: np.ndarray, theta_local: np.ndarray, chunk: int = 1 << 20) -> float:
    """||θ_global - θ_local||, a chunk at a time (no full-size temporary)."""
    sq = 0.0
    for a in range(0, theta_global.size, chunk):
        d = np.subtract(theta_global[a:a + chunk], theta_local[a:a + chunk], dtype=np.float32)
        sq += float(np.dot(d, d))
    return sq ** 0.5
