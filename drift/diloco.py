"""The DiLoCo algorithm, apart from any networking: the flat θ, pseudo-gradients, the outer
optimizer and the checksum every node reports. The sync rules built from them are drift/sync/.

One outer round, as a node sees it:
    delta   = theta_global - theta_local            (how far this node's copy moved)
    avg     = sum_i w_i * delta_i                    (ring all-reduce; w_i = samples_i / total)
    theta_global <- outer step with avg              (e.g. Nesterov SGD: drift/sync/dense.py)

Invariant: every node applies the same float32 operations, in the same order, to the same
inputs, so theta_global stays bit-identical across the swarm; the checksum proves it each round.
The operations are elementwise, so doing them a chunk at a time (to keep no full-size
temporaries) changes no bit.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

CHUNK = 1 << 20  # values per piece of an elementwise pass: no temporary the size of θ


@dataclass(frozen=True)
class ParamLayout:
    """Where each named tensor lives in the flat float32 vector: the parameters (names sorted),
    then the model's floating-point buffers (BatchNorm statistics; names sorted). Buffers are
    averaged across nodes and checkpointed with θ, but not trained by the outer optimizer."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    n_buffers: int = 0  # the last n_buffers names are buffers

    @classmethod
    def of(cls, params: dict[str, np.ndarray], buffers: dict[str, np.ndarray] | None = None) -> ParamLayout:
        return cls.of_shapes(
            {n: np.shape(a) for n, a in params.items()}, {n: np.shape(a) for n, a in (buffers or {}).items()}
        )

    @classmethod
    def of_shapes(
        cls, params: dict[str, tuple[int, ...]], buffers: dict[str, tuple[int, ...]] | None = None
    ) -> ParamLayout:
        """The layout of tensors of these shapes (no tensor needed: a node never copies θ to learn it)."""
        buffers = buffers or {}
        if clash := sorted(set(params) & set(buffers)):
            raise ValueError(f"{clash[0]} is both a parameter and a buffer")
        every = {**params, **buffers}
        names = (*sorted(params), *sorted(buffers))
        return cls(names, tuple(tuple(every[n]) for n in names), len(buffers))

    @property
    def size(self) -> int:
        return sum(int(np.prod(s)) for s in self.shapes)

    def digest(self) -> str:
        """A short hash of the names, shapes and order (what a donor's layout must match)."""
        text = json.dumps([list(self.names), [list(x) for x in self.shapes], self.n_buffers])
        return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()

    @property
    def params_size(self) -> int:
        """Values that are parameters: θ[:params_size]; the rest are buffers."""
        return sum(int(np.prod(s)) for s in self.shapes[: len(self.shapes) - self.n_buffers])

    @property
    def buffer_names(self) -> tuple[str, ...]:
        return self.names[len(self.names) - self.n_buffers :]

    def slices(self) -> Iterable[tuple[str, slice, tuple[int, ...]]]:
        """(name, where in the flat vector, shape) for every tensor, in order."""
        i = 0
        for name, shape in zip(self.names, self.shapes):
            n = int(np.prod(shape))
            yield name, slice(i, i + n), shape
            i += n

    def flatten(self, params: dict[str, np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
        if set(params) != set(self.names):
            missing = sorted(set(self.names) - set(params))
            extra = sorted(set(params) - set(self.names))
            raise ValueError(f"parameter names differ: missing {missing}, unexpected {extra}")
        out = np.empty(self.size, dtype=np.float32) if out is None else out
        for name, sl, shape in self.slices():
            a = params[name]
            if tuple(np.shape(a)) != shape:
                raise ValueError(f"parameter {name}: shape {tuple(np.shape(a))}, expected {shape}")
            out[sl] = np.reshape(a, -1)
        return out

    def unflatten(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Views into `flat` (no copy), one per name."""
        return {name: flat[sl].reshape(shape) for name, sl, shape in self.slices()}

    def split(self, named: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(parameters, buffers) of a dict over all names (e.g. unflatten's views)."""
        buffers = set(self.buffer_names)
        return ({k: v for k, v in named.items() if k not in buffers}, {k: v for k, v in named.items() if k in buffers})


def sgd_step(theta: np.ndarray, grad: np.ndarray, lr: np.float32, params: int) -> None:
    """θ -= lr * grad on the parameters (θ[:params]), θ -= grad on the buffers, in place and a chunk
    at a time; `grad` is left scaled."""
    for a in range(0, params, CHUNK):
        b = min(a + CHUNK, params)
        gc = grad[a:b]
        gc *= lr
        theta[a:b] -= gc
    theta[params:] -= grad[params:]


class NesterovOuter:
    """SGD with Nesterov momentum on the pseudo-gradient (DiLoCo: lr 0.7, momentum 0.9).

    Same update as torch.optim.SGD(nesterov=True): v = mu*v + g; theta -= lr*(g + mu*v).
    Only θ[:params]: the buffers that follow are plain averages (θ_buf -= avg Δ_buf).

    With momentum 0 the step is theta -= lr*g and the velocity is never written: it stays the
    zeros np.zeros gave it, pages the OS does not back until written, so a node without outer
    momentum holds one copy of θ less (and state transfer keeps it so: state.into_arrays).
    """

    def __init__(
        self, size: int, lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True, params: int | None = None
    ):
        self.lr = np.float32(lr)
        self.momentum = np.float32(momentum)
        self.nesterov = nesterov
        self.params = size if params is None else params
        self.velocity = np.zeros(size, dtype=np.float32)

    def step(self, theta: np.ndarray, grad: np.ndarray) -> None:
        """Update theta (and the velocity) in place; `grad` is used as scratch and left garbled."""
        v, mu = self.velocity, self.momentum
        if mu == 0:  # (v would be g itself, and nothing reads it)
            sgd_step(theta, grad, self.lr, self.params)
            return
        for a in range(0, self.params, CHUNK):
            b = min(a + CHUNK, self.params)
            vc, gc = v[a:b], grad[a:b]
            vc *= mu
            vc += gc
            if self.nesterov:
                gc += mu * vc  # g + mu*v, as torch's SGD(nesterov=True)
            else:
                gc[...] = vc
            gc *= self.lr
            theta[a:b] -= gc
        theta[self.params :] -= grad[self.params :]  # buffers: the weighted average of the nodes'

    def preview(self, theta: np.ndarray, grad: np.ndarray) -> str:
        """checksum(θ, velocity) as it would be after step(θ, grad), bit for bit, with nothing
        changed (a two-node swarm compares it before either node applies the step)."""
        v, mu = self.velocity, self.momentum
        if mu == 0:
            return sgd_preview(theta, grad, self.lr, self.params, v)
        h = PieceHash()
        # The same float32 operations as step(), in scratch: θ's bytes first, then the velocity's
        # (the checksum's order), so v*mu + g is computed twice rather than kept.
        vc, gc = np.empty(min(CHUNK, self.params), np.float32), np.empty(min(CHUNK, self.params), np.float32)
        for a in range(0, self.params, CHUNK):
            b = min(a + CHUNK, self.params)
            vs, gs = vc[: b - a], gc[: b - a]
            np.multiply(v[a:b], mu, out=vs)
            vs += grad[a:b]
            if self.nesterov:
                np.multiply(vs, mu, out=gs)
                gs += grad[a:b]
            else:
                gs[...] = vs
            gs *= self.lr
            np.subtract(theta[a:b], gs, out=gs)
            h.update(gs.view(np.uint8))
        h.update((theta[self.params :] - grad[self.params :]).view(np.uint8))
        h.end_array()
        for a in range(0, self.params, CHUNK):
            b = min(a + CHUNK, self.params)
            vs = vc[: b - a]
            np.multiply(v[a:b], mu, out=vs)
            vs += grad[a:b]
            h.update(vs.view(np.uint8))
        h.update(v[self.params :].view(np.uint8))
        h.end_array()
        return h.hexdigest()


def sgd_preview(theta: np.ndarray, grad: np.ndarray, lr: np.float32, params: int, *state: np.ndarray) -> str:
    """checksum(θ, *state) as it would be after sgd_step(θ, grad, lr, params), computed a chunk
    at a time into scratch: θ, `grad` and the state are left as they are."""
    h = PieceHash()
    for a in range(0, theta.size, CHUNK):
        b = min(a + CHUNK, theta.size)
        g = grad[a:b].copy()
        if a < params:  # (CHUNK divides nothing in particular: a chunk may hold params and buffers)
            g[: params - a] *= lr
        h.update((theta[a:b] - g).view(np.uint8))
    h.end_array()
    for x in state:
        h.update(np.ascontiguousarray(x).view(np.uint8))
        h.end_array()
    return h.hexdigest()


def checksum(theta: np.ndarray, *state: np.ndarray) -> str:
    """A short digest of the exact bytes of θ and then of the sync rule's shared state arrays, in
    the rule's order: the swarm agrees on all of them each round, so a peer that hands over a
    poisoned velocity is caught too. It is the root of their pieces (PieceHash), so a transfer
    can check each piece as it arrives."""
    return checksum_of([a] for a in (theta, *state))


def stream_checksum(*arrays: np.ndarray) -> str:
    """The checksum before drift-state/1: one blake2b over all the bytes. Checkpoints written then
    carry it in their manifest; only resuming one still reads it."""
    h = hashlib.blake2b(digest_size=12)
    for a in arrays:
        h.update(np.ascontiguousarray(a).view(np.uint8))
    return h.hexdigest()


def checksum_of(arrays: Iterable[Iterable[np.ndarray]]) -> str:
    """checksum() of arrays given each as its blocks, one after another (a step's result a block
    at a time, never the whole θ at once)."""
    h = PieceHash()
    for blocks in arrays:
        for a in blocks:
            h.update(np.ascontiguousarray(a).view(np.uint8))
        h.end_array()
    return h.hexdigest()


# The swarm's checksum is content-addressed: each array (θ, then each state array) is cut into
# PIECE_BYTES pieces, each piece has a blake2b digest, and the checksum is the blake2b of the piece
# digests in order. A receiver that holds the digests (checked against the checksum) checks each
# piece on arrival, from whichever holder it came.
PIECE_BYTES = 4 << 20
PIECE_DIGEST = 16  # bytes of blake2b per piece


class PieceHash:
    """The checksum of bytes fed in order, array by array (`end_array` after each); `pieces`
    holds the piece digests so far. Nothing is kept but the digests."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self._h = hashlib.blake2b(digest_size=PIECE_DIGEST)
        self._n = 0  # bytes in the current piece

    def update(self, data: np.ndarray | bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), PIECE_BYTES - self._n)
            self._h.update(view[:take])
            self._n += take
            view = view[take:]
            if self._n == PIECE_BYTES:
                self._cut()

    def end_array(self) -> None:
        """The current array ends here: its last piece may be short."""
        if self._n:
            self._cut()

    def _cut(self) -> None:
        self.pieces.append(self._h.digest())
        self._h, self._n = hashlib.blake2b(digest_size=PIECE_DIGEST), 0

    def hexdigest(self) -> str:
        """The root over the pieces of the arrays ended so far (remembered: pieces_of)."""
        root = root_of(self.pieces)
        _remember(root, tuple(self.pieces))
        return root


def root_of(pieces: Iterable[bytes]) -> str:
    """The checksum of arrays whose piece digests are these, in order."""
    return hashlib.blake2b(b"".join(pieces), digest_size=12).hexdigest()


def piece_digest(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=PIECE_DIGEST).digest()


def piece_spans(nbytes: int, arrays: int) -> list[tuple[int, int, int]]:
    """(which array, byte offset, length) of every piece of `arrays` arrays of `nbytes` each."""
    return [(w, o, min(PIECE_BYTES, nbytes - o)) for w in range(arrays) for o in range(0, nbytes, PIECE_BYTES)]


# The piece digests of the last few checksums computed here, by checksum: a state server hands
# them to a joiner without hashing θ again (the same checksum means the same pieces, whoever
# computed it).
_RECENT: OrderedDict[str, tuple[bytes, ...]] = OrderedDict()
_RECENT_MAX = 16
_recent_lock = threading.Lock()


def _remember(root: str, pieces: tuple[bytes, ...]) -> None:
    with _recent_lock:
        _RECENT[root] = pieces
        _RECENT.move_to_end(root)
        while len(_RECENT) > _RECENT_MAX:
            _RECENT.popitem(last=False)


def pieces_of(root: str) -> tuple[bytes, ...] | None:
    """The piece digests of checksum `root`, if this process computed it lately."""
    with _recent_lock:
        return _RECENT.get(root)


def weighted_delta(theta_global: np.ndarray, theta_local: np.ndarray, weight: float) -> np.ndarray:
    """w_i * (theta_global - theta_local), the vector this node feeds the all-reduce. A node of
    weight 0 sends exact zeros (0 * NaN would be NaN: a node whose Δ went bad sends nothing)."""
    if weight == 0:
        return np.zeros(theta_global.shape, dtype=np.float32)
    out = np.subtract(theta_global, theta_local, dtype=np.float32)
    out *= np.float32(weight)
    return out


def l2norm(x: np.ndarray) -> float:
    """||x||, chunked (no temporary the size of θ); inf or nan when x holds them."""
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.sqrt(sum(float(np.dot(x[a : a + CHUNK], x[a : a + CHUNK])) for a in range(0, x.size, CHUNK))))


# The reduced Δ may exceed Σ w·||Δ_i|| by this much before it is refused. Codec error adds next to
# nothing to a norm (int8 blocks over a ring of 16 identical Δs: +0.004 %); the margin is for
# rounding. A member of weight w that sends -k x its Δ makes the sum (1 - (k+1)w)Δ when every Δ is
# alike (the worst case): a x10 flip is refused for w > (2 + NORM_SLACK)/11 = 0.186, so a liar at a
# fair share of a swarm of five or fewer is caught; below that it reverses the step by at most
# 1 + NORM_SLACK (and under w < 1/11 only shrinks it).
NORM_SLACK = 0.05


def norm_bound(members: Iterable[tuple[float, float | None]]) -> float | None:
    """Σ w_i·||Δ_i|| over (weight, reported norm) of a ring's members: what its sum may reach
    (reduced_problem); None when a member of weight > 0 reported no norm (no check)."""
    counted = [(w, n) for w, n in members if w > 0]
    if any(n is None for _, n in counted):
        return None
    return sum(w * n for w, n in counted)


def reduced_problem(reduced: np.ndarray, bound: float | None) -> str | None:
    """A node's check of the all-reduced Δ before the outer step: the norm of a sum is at most the
    sum of the norms, so Σ w_i·Δ_i can be no larger than `bound`, Σ w_i·||Δ_i|| with the norms every
    member reported at the barrier (norm_bound, plus codec error). A member that sent more than it
    reported (×1000, sign-flipped ×10, noise, 1e30, NaN) makes the sum break that bound. None if it
    holds (or there is no bound), else what is wrong."""
    if bound is None:
        return None
    got = l2norm(reduced)
    if not np.isfinite(got) or got > (1 + NORM_SLACK) * bound + 1e-12:
        return f"the all-reduced Δ has norm {got:.4g}, more than the {bound:.4g} its members' reported norms allow"
    return None


class DeltaCheck:
    """A node's sanity check of its own pseudo-gradient before it goes into the all-reduce: a Δ
    with NaN/Inf (an fp16 overflow on one device is enough) or one whose size per inner step is
    absurdly larger than this node's recent ones would poison θ on every node, so it is reported
    instead of sent. Size per step, because a node may train 1 step one round and 100 the next."""

    def __init__(self, factor: float = 100.0, history: int = 5):
        self.factor, self.history = factor, history
        self.recent: list[float] = []
        self.norm: float | None = None  # of the last Δ checked (reported at the barrier)

    def problem(self, delta: np.ndarray, steps: int) -> str | None:
        """None if Δ is fine (and then it joins the history), else what is wrong with it."""
        norm = self.norm = l2norm(delta)
        if not np.isfinite(norm):
            return "its pseudo-gradient has NaN or Inf values"
        per_step = norm / max(steps, 1)
        if len(self.recent) >= 3:
            typical = float(np.median(self.recent))
            if typical > 0 and per_step > self.factor * typical:
                return f"its pseudo-gradient is {per_step / typical:.0f}x larger per step than its recent ones"
        self.recent = ([*self.recent, per_step])[-self.history :]
        return None


def epoch_order(n_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The epoch's sample order: the same permutation on every node."""
    return np.random.default_rng([seed, epoch]).permutation(n_samples)


def unit_indices(order: np.ndarray, unit, unit_samples: int) -> np.ndarray:
    """The samples [unit.lo, unit.hi) of work unit `unit.id` (units tile the epoch's order)."""
    base = unit.id * unit_samples
    return order[base + unit.lo : base + min(unit.hi, unit_samples)]
