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


def checksum(theta: np.ndarray) -> str:
    """A short digest of the exact bytes of theta."""
    return hashlib.blake2b(np.ascontiguousarray(theta).view(np.uint8), digest_size=12).hexdigest()


def weighted_delta(theta_global: np.ndarray, theta_local: np.ndarray, weight: float) -> np.ndarray:
    """w_i * (theta_global - theta_local), the vector this node feeds the all-reduce."""
    out = np.subtract(theta_global, theta_local, dtype=np.float32)
    out *= np.float32(weight)
    return out


def epoch_order(n_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The epoch's sample order: the same permutation on every node."""
    return np.random.default_rng([seed, epoch]).permutation(n_samples)


def unit_indices(order: np.ndarray, unit, unit_samples: int) -> np.ndarray:  # noqa: ANN001 - a WorkUnit
    """The samples [unit.lo, unit.hi) of work unit `unit.id` (units tile the epoch's order)."""
    base = unit.id * unit_samples
    return order[base + unit.lo:base + min(unit.hi, unit_samples)]
