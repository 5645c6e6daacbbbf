"""The real code run once per branch of its randomness: its two doors to randomness replaced.

Speculative decoding makes random choices of two kinds, and the code under proof makes them
through two doors:

* token draws, ``speculative.sampling.sample`` / ``sample_rows`` (a token from a law), and
  ``sample_keyed``, the Gumbel-max draw with noise keyed by position, whose token has the law it is
  given (the Gumbel-max lemma) and is enumerated as a draw from it; that is exact where no position's
  noise decides two emitted tokens, which the rule that uses it ensures by keying the noise by the
  position in the sequence (tests/speculative/verify/test_invariant.py checks that keying);
* uniforms, ``torch.rand``, compared with thresholds (``r < p/q``, ``eta < h``).

:class:`Branching` replaces both doors while it is installed. A draw becomes a branch per
token of positive probability. A uniform becomes an interval, [0, 1) at first; each
comparison with a threshold inside the interval becomes a branch per side, with the side's
share of the interval as its probability, and the comparison answers for a point inside the
chosen side, so the code's own comparison decides, whatever its operator (``<`` or ``<=``:
they differ only on a set of measure 0; the zero draw of :class:`Branching` is for that set).
A uniform may first be scaled and shifted (``r * q < p``); anything else done with it (a
log, a sort, an inverse CDF) and any other source of randomness (``torch.multinomial``,
``Tensor.uniform_``, ...) raises :class:`NotApplicable`: the law of such code cannot be
followed this way.

A :class:`Chooser` takes every branch's decision from a script and notes the branches it did
not take; :func:`enumerate_runs` replays the code once per script, depth first, so every
outcome is reached once per way it can happen, with its exact probability (a float64 product
of the laws' entries and the intervals' shares).

Branches are made lazily where the code allows it: a verifier's comparisons and draws are
decided only when the host reads them (through ``speculative.inputs.read_host``, the one
copy of a Verdict), so a token-wise verification of gamma drafts costs about gamma + 1 runs
per outcome instead of 2^gamma V^(gamma+1). Code that computes with an undecided value on the
device restarts the enumeration with every branch decided where it is made.

speculative.proofs.exact runs verifiers and whole generations under it.
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch

from speculative import inputs, sampling


class NotApplicable(BaseException):  # noqa: N818 -- a BaseException, so that a rule's `except Exception` passes it
    """The code draws randomness the enumeration cannot follow; ``reason`` says which."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class NeedsEager(BaseException):  # noqa: N818
    """An undecided value was used on the device: decide every branch where it is made."""


class Broken(Exception):  # noqa: N818
    """The code did something no exact rule can do (a law with a negative entry, a verdict
    that breaks the verifier contract); the message says what."""


class Contract(Exception):  # noqa: N818
    """The code returned the wrong kind of thing (not a Verdict); the message says what."""


# ----------------------------------------------------------------------------- the search
class Chooser:
    """Random choices from a script: choice k is script[k] while the script lasts, then the
    first option with weight > 0, noting the other options so the search can visit them."""

    def __init__(self, script: list[int]) -> None:
        self.script = script
        self.path: list[int] = []  # the choices made so far
        self.prob = 1.0  # their probability
        self.branches: list[list[int]] = []

    def choose(self, weights: Sequence[float]) -> int:
        options = [i for i, w in enumerate(weights) if w > 0]
        k = len(self.path)
        if k < len(self.script):
            pick = self.script[k]
        else:
            pick = options[0]
            self.branches += [self.path + [alt] for alt in options[1:]]
        self.path.append(pick)
        self.prob *= weights[pick]
        return pick


def enumerate_runs(run: Callable[[Chooser], Hashable]) -> dict[Hashable, float]:
    """The exact law of ``run(chooser)``'s outcome, summed over every script (depth first)."""
    law: dict[Hashable, float] = {}
    todo: list[list[int]] = [[]]
    while todo:
        chooser = Chooser(todo.pop())
        outcome = run(chooser)
        law[outcome] = law.get(outcome, 0.0) + chooser.prob
        todo += chooser.branches
    return law


# ----------------------------------------------------------------------------- uniforms and draws
COMPARISONS = {
    "lt": operator.lt,
    "__lt__": operator.lt,
    "less": operator.lt,
    "le": operator.le,
    "__le__": operator.le,
    "less_equal": operator.le,
    "gt": operator.gt,
    "__gt__": operator.gt,
    "greater": operator.gt,
    "ge": operator.ge,
    "__ge__": operator.ge,
    "greater_equal": operator.ge,
}
METADATA = {
    "__get__",
    "size",
    "dim",
    "numel",
    "nelement",
    "ndimension",
    "is_floating_point",
    "__len__",
    "element_size",
    "is_contiguous",
    "__repr__",
    "__format__",
    "data_ptr",
    "get_device",
}
IDENTITY = {
    "to",
    "double",
    "float",
    "half",
    "bfloat16",
    "cpu",
    "cuda",
    "type",
    "detach",
    "clone",
    "contiguous",
    "type_as",
}
REARRANGE = {
    "__getitem__",
    "view",
    "reshape",
    "unsqueeze",
    "squeeze",
    "flatten",
    "expand",
    "expand_as",
    "permute",
    "transpose",
    "t",
    "flip",
    "select",
    "narrow",
    "split",
    "chunk",
    "unbind",
    "view_as",
    "reshape_as",
    "index_select",
    "cat",
    "stack",
    "movedim",
    "broadcast_to",
}
READS = {"tolist", "item", "__bool__", "__int__", "__index__", "__float__", "numpy"}
SCALE = {"mul", "__mul__", "__rmul__", "multiply"}
DIVIDE = {"div", "__truediv__", "true_divide", "divide"}
SHIFT = {"add", "__add__", "__radd__"}
SUBTRACT = {"sub", "__sub__", "subtract"}
FLIP = {"__rsub__", "rsub"}
NEGATE = {"neg", "__neg__", "negative"}
FORBIDDEN = [
    "multinomial",
    "randint",
    "randn",
    "randperm",
    "bernoulli",
    "normal",
    "poisson",
    "randint_like",
    "randn_like",
]
FORBIDDEN_METHODS = [
    "uniform_",
    "normal_",
    "exponential_",
    "bernoulli_",
    "random_",
    "geometric_",
    "cauchy_",
    "log_normal_",
    "multinomial",
]


def plain(func: Callable, args: Sequence, kwargs: dict) -> Any:
    """func on the tensors' data, as if none of them were a subclass."""
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def substitute(value: Any, field: str) -> Any:
    """``value`` with every Uniforms in it (nested in lists and tuples too) replaced by its ``field``."""
    if isinstance(value, Uniforms):
        return getattr(value, field)
    if isinstance(value, (list, tuple)):
        if any(isinstance(v, torch.Tensor) and not isinstance(v, Uniforms) for v in value) and any(
            isinstance(v, Uniforms) for v in value
        ):
            raise NotApplicable("it mixes its uniform draws with other tensors in one tensor")
        return type(value)(substitute(v, field) for v in value)
    return value


class Placeholder(torch.Tensor):
    """A tensor whose data stand in for values the enumeration keeps elsewhere: its shape, dtype
    and device are real, anything else done with it is the subclass's :meth:`handle`."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in METADATA:
            return plain(func, args, kwargs)
        return cls.handle(func, name, args, kwargs)


class Uniforms(Placeholder):
    """Draws of torch.rand while :class:`Branching` is installed: element k is
    ``scale[k] * u + shift[k]`` for the uniform u number ``ids[k]`` of the run (its interval
    is kept by the Branching). Its data are placeholders."""

    branching: Branching
    ids: torch.Tensor
    scale: torch.Tensor
    shift: torch.Tensor

    @classmethod
    def make(
        cls,
        data: torch.Tensor,
        branching: Branching,
        ids: torch.Tensor,
        scale: torch.Tensor,
        shift: torch.Tensor,
    ) -> Uniforms:
        out = data.as_subclass(cls)
        out.branching = branching
        out.ids = ids
        out.scale = scale
        out.shift = shift
        return out

    @classmethod
    def handle(cls, func: Callable, name: str, args: Sequence, kwargs: dict) -> Any:
        u = next(
            (
                a
                for a in list(args) + [x for a in args if isinstance(a, (list, tuple)) for x in a]
                if isinstance(a, Uniforms)
            ),
            None,
        )
        if u is None:
            raise NotApplicable(f"it passes its uniform draws to {name} by keyword")
        if name in COMPARISONS:
            return u.branching.compare(COMPARISONS[name], args)
        if name in IDENTITY:
            return cls.make(plain(func, args, kwargs), u.branching, u.ids, u.scale, u.shift)
        if name in REARRANGE:
            data, ids, scale, shift = (
                plain(func, substitute(args, f), kwargs) if f else plain(func, args, kwargs)
                for f in (None, "ids", "scale", "shift")
            )
            if isinstance(data, (list, tuple)):
                return type(data)(
                    cls.make(d, u.branching, i, s, h) for d, i, s, h in zip(data, ids, scale, shift)
                )
            return cls.make(data, u.branching, ids, scale, shift)
        if name in SCALE | DIVIDE | SHIFT | SUBTRACT | FLIP | NEGATE and not kwargs:
            return u.branching.affine(name, args)
        if name in READS:
            raise NotApplicable(
                "it reads its uniform draws as numbers (.item(), .tolist()); compare them with "
                "thresholds instead"
            )
        raise NotApplicable(
            f"it computes {name} of its uniform draws; only comparisons with thresholds "
            "(after scaling or shifting) can be followed"
        )


class Pending(Placeholder):
    """Values not decided yet: comparisons of uniforms and token draws, each element decided
    when the host reads it. Its data are placeholders; any computation with it on the device
    raises NeedsEager."""

    branching: Branching
    deciders: list[Callable[[], int]]
    decided: dict[int, int]

    @classmethod
    def make(
        cls, data: torch.Tensor, branching: Branching, deciders: list[Callable[[], int]]
    ) -> Pending:
        out = data.as_subclass(cls)
        out.branching = branching
        out.deciders = deciders
        out.decided = {}
        return out

    def value(self, k: int) -> int:
        if k not in self.decided:
            self.decided[k] = self.deciders[k]()
        return self.decided[k]

    @classmethod
    def handle(cls, func: Callable, name: str, args: Sequence, kwargs: dict) -> Any:
        # a read on the host decides every element
        if name in READS and isinstance(args[0], Pending):
            pending = args[0]
            values = torch.tensor(
                [pending.value(k) for k in range(len(pending.deciders))], dtype=pending.dtype
            )
            return plain(func, [values.view(pending.shape)] + list(args[1:]), kwargs)
        raise NeedsEager()


class Lazy(Sequence):
    """The host copy of a Pending tensor: element k is decided when it is first read."""

    def __init__(self, pending: Pending, index: range | None = None) -> None:
        self.pending = pending
        if index is None:  # the whole tensor
            index = range(len(pending.deciders))
        self.at = index

    def __len__(self) -> int:
        return len(self.at)

    def __getitem__(self, k: int | slice) -> Any:
        if isinstance(k, slice):
            return Lazy(self.pending, self.at[k])
        return self.pending.value(self.at[k])

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented

    def __add__(self, other: Sequence) -> list:
        return list(self) + list(other)

    def __radd__(self, other: Sequence) -> list:
        return list(other) + list(self)

    def __repr__(self) -> str:
        return repr(list(self))


class Branching:
    """While installed (a context manager), torch.rand gives :class:`Uniforms` and the samplers
    of speculative.sampling (every binding of them, in every loaded module) choose through
    ``self.chooser``; speculative.inputs.read_host gives :class:`Lazy` copies of Pending parts;
    every other random function of torch raises NotApplicable.

    ``zero``: torch.rand returns exactly 0, the one value of [0, 1) that has probability 0
    under the interval branches but that torch.rand can return (about once in 2^24 float32
    draws): the draws then branch, the uniforms do not. ``seed`` seeds the generator handed to
    the code (which the patched draws ignore: a law that changes with it has a source of
    randomness the enumeration misses)."""

    def __init__(self, zero: bool = False, seed: int = 0) -> None:
        self.zero = zero
        self.lazy = True
        self.seed = seed
        self.chooser: Chooser | None = None
        self.intervals: list[list[float]] = []
        self.saved: list[tuple[Any, str, Any]] = []

    # -------------------------------------------------------------- install / remove
    def __enter__(self) -> Branching:
        real = {
            "sample": sampling.sample,
            "sample_rows": sampling.sample_rows,
            "sample_keyed": sampling.sample_keyed,
            "read_host": inputs.read_host,
        }
        fake = {
            "sample": self.sample,
            "sample_rows": self.sample_rows,
            "sample_keyed": self.sample,
            "read_host": self.read_host,
        }
        try:
            for module in list(sys.modules.values()):
                space = getattr(module, "__dict__", None)
                if not isinstance(space, dict):
                    continue
                for name, function in real.items():
                    if space.get(name) is function:
                        self.patch(module, name, fake[name])
            self.patch(torch, "rand", self.rand)
            self.patch(
                torch,
                "rand_like",
                lambda x, **kw: self.rand(*x.shape, dtype=kw.get("dtype", x.dtype)),
            )
            for name in FORBIDDEN:
                self.patch(torch, name, self.forbidden(f"torch.{name}"))
            for name in FORBIDDEN_METHODS:
                self.patch(torch.Tensor, name, self.forbidden(f"Tensor.{name}"))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        while self.saved:
            owner, name, value = self.saved.pop()
            setattr(owner, name, value)

    def patch(self, owner: Any, name: str, value: Any) -> None:
        self.saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    @staticmethod
    def forbidden(name: str) -> Callable:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise NotApplicable(
                f"it draws with {name}, which the enumeration cannot follow (draw tokens with "
                "speculative.sampling.sample and uniforms with torch.rand)"
            )

        return refuse

    # -------------------------------------------------------------- runs
    def enumerate(self, run: Callable[[], Hashable]) -> dict[Hashable, float]:
        """The exact law of ``run()``, lazily where it allows, else with every branch decided
        where it is made."""

        def scripted(chooser: Chooser) -> Hashable:
            self.chooser = chooser
            self.intervals = []
            return run()

        try:
            return enumerate_runs(scripted)
        except NeedsEager:
            self.lazy = False
            return enumerate_runs(scripted)

    def choose(self, weights: Sequence[float]) -> int:
        if self.chooser is None:
            raise RuntimeError("Branching.enumerate runs the code")
        return self.chooser.choose(weights)

    # -------------------------------------------------------------- torch.rand
    def rand(
        self,
        *size: Any,
        generator: Any = None,
        dtype: torch.dtype | None = None,
        device: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        shape = size
        if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):  # rand((2, 3))
            shape = tuple(size[0])
        dtype = dtype or torch.get_default_dtype()
        if self.zero:
            return torch.zeros(shape, dtype=dtype, device=device)
        count = math.prod(shape)
        ids = torch.arange(len(self.intervals), len(self.intervals) + count).view(shape)
        self.intervals += [[0.0, 1.0] for _ in range(count)]
        return Uniforms.make(
            torch.full(shape, 0.5, dtype=dtype, device=device),
            self,
            ids,
            torch.ones(shape, dtype=torch.float64),
            torch.zeros(shape, dtype=torch.float64),
        )

    def affine(self, name: str, args: Sequence) -> Uniforms:
        """scale * u + shift, scaled or shifted by a number or tensor that is not a draw."""
        func = getattr(torch.Tensor, name) if hasattr(torch.Tensor, name) else getattr(torch, name)
        data = plain(func, args, {})
        at = 0 if isinstance(args[0], Uniforms) else 1
        u = args[at]
        if len(args) > 1 and isinstance(args[1 - at], Uniforms):
            raise NotApplicable(
                "it combines two uniform draws; each must be compared with a threshold alone"
            )
        c = None  # the number or tensor the draws are combined with; none for a negation
        if len(args) > 1:
            c = torch.as_tensor(args[1 - at], dtype=torch.float64).as_subclass(torch.Tensor)
        scale, shift = u.scale, u.shift
        if name in SCALE:
            scale, shift = scale * c, shift * c
        elif name in DIVIDE and at == 0:
            scale, shift = scale / c, shift / c
        elif name in SHIFT:
            shift = shift + c
        elif name in SUBTRACT and at == 0:
            shift = shift - c
        elif name in FLIP or name in SUBTRACT:
            scale, shift = -scale, c - shift
        elif name in NEGATE:
            scale, shift = -scale, -shift
        else:
            raise NotApplicable(f"it divides by its uniform draws ({name})")
        shape = plain(torch.Tensor.size, (data,), {})
        return Uniforms.make(
            data,
            self,
            torch.broadcast_to(u.ids, shape),
            torch.broadcast_to(scale, shape),
            torch.broadcast_to(shift, shape),
        )

    def compare(self, op: Callable[[float, float], bool], args: Sequence) -> torch.Tensor:
        """A comparison of draws with thresholds: one branch per element whose threshold splits
        its uniform's interval, decided now or when read."""
        at = 0 if isinstance(args[0], Uniforms) else 1
        u, other = args[at], args[1 - at]
        if isinstance(other, Uniforms):
            raise NotApplicable("it compares two uniform draws with each other")
        data = plain(operator.lt, (u, other), {})  # only the shape and device matter
        shape = plain(torch.Tensor.size, (data,), {})
        threshold = (
            torch.broadcast_to(
                torch.as_tensor(other, dtype=torch.float64).as_subclass(torch.Tensor).cpu(), shape
            )
            .flatten()
            .tolist()
        )
        ids, scale, shift = (
            torch.broadcast_to(t, shape).flatten().tolist() for t in (u.ids, u.scale, u.shift)
        )
        deciders = [self.decider(op, at, *element) for element in zip(ids, scale, shift, threshold)]
        if self.lazy:
            return Pending.make(data, self, deciders)
        return torch.tensor([d() for d in deciders], dtype=torch.bool, device=data.device).view(
            shape
        )

    def decider(
        self, op: Callable, at: int, uid: int, scale: float, shift: float, a: float
    ) -> Callable[[], int]:
        def decide() -> int:
            lo, hi = self.intervals[uid]
            if scale != 0:
                t = (a - shift) / scale  # the comparison flips where u crosses t
                if lo < t < hi:
                    below = (t - lo) / (hi - lo)
                    side = self.choose([below, 1 - below])
                    self.intervals[uid] = [lo, t] if side == 0 else [t, hi]
                    lo, hi = self.intervals[uid]
            v = scale * (lo + hi) / 2 + shift
            return int(op(v, a) if at == 0 else op(a, v))

        return decide

    # -------------------------------------------------------------- token draws
    def law(self, row: torch.Tensor) -> list[float]:
        weights = row.detach().double().cpu().tolist()
        total = math.fsum(weights)
        if any(not w >= 0 or w == math.inf for w in weights) or not total > 0:
            raise Broken(
                f"a law handed to the sampler is not a distribution: {[round(w, 6) for w in weights]}"
            )
        return [w / total for w in weights]

    def sample(self, probs: torch.Tensor, generator: Any = None) -> torch.Tensor:
        flat = probs.reshape(-1, probs.shape[-1])
        laws = [self.law(row) for row in flat]
        if self.lazy:
            deciders = [(lambda law=law: self.choose(law)) for law in laws]
            return Pending.make(flat.argmax(-1).view(probs.shape[:-1]), self, deciders)
        return torch.tensor([self.choose(law) for law in laws], device=probs.device).view(
            probs.shape[:-1]
        )

    def sample_rows(self, probs: torch.Tensor, generators: list) -> torch.Tensor:
        return torch.tensor(
            [
                self.choose(self.law(row)) if gen is not None else int(row.argmax())
                for row, gen in zip(probs, generators)
            ],
            device=probs.device,
        )

    # -------------------------------------------------------------- the host read
    def read_host(self, parts: Sequence[torch.Tensor], finite: torch.Tensor | None = None) -> list:
        plain_parts = [part for part in parts if not isinstance(part, Pending)]
        values: list = []
        if plain_parts or finite is not None:
            values = inputs_read_host(plain_parts, finite)
        host: Iterator = iter(values)
        return [Lazy(part) if isinstance(part, Pending) else next(host) for part in parts]


inputs_read_host = inputs.read_host
