"""Python reward functions named in ``reward.functions``: resolving them, and one call that
turns every failure into an error naming the function and the record."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import math
import numbers
import warnings
from collections.abc import Callable

from oppo_jax.base.errors import InputError

# fn(prompt, response, record) -> float: the decoded prompt and response (special tokens
# skipped) and the prompt's dataset record.
RewardCallable = Callable[[str, str, dict], float]


class RewardFunctionError(InputError):
    """A reward function raised, or returned something that is not a finite number."""


@dataclasses.dataclass(frozen=True)
class RewardFunction:
    """One weighted reward function."""

    name: str  # "package.module:function", as in the config
    fn: RewardCallable
    weight: float

    @property
    def short_name(self) -> str:
        """The function's own name (metric keys: ``reward_fn/<short_name>``)."""
        return self.name.rpartition(":")[2]


def _bind(fn: Callable, kwargs: dict, key: str) -> RewardCallable:
    """``fn`` with ``reward.kwargs`` entry ``kwargs`` bound; an argument it does not take is
    an error naming the key."""
    if not kwargs:
        return fn
    try:
        inspect.signature(fn).bind("prompt", "response", {}, **kwargs)
    except TypeError as e:
        raise InputError(f"{key}: {e}") from None
    except ValueError:  # no signature to check (a builtin): the call will tell
        pass
    return functools.partial(fn, **kwargs)


def resolve(
    names: list[str], weights: list[float], kwargs: list[dict] = ()
) -> list[RewardFunction]:
    """Import every ``package.module:function`` of ``reward.functions``, with its keyword
    arguments of ``reward.kwargs`` bound; errors name the key."""
    weights = list(weights) or [1.0] * len(names)
    kwargs = list(kwargs) or [{}] * len(names)
    out = []
    for i, (name, weight) in enumerate(zip(names, weights, strict=True)):
        module_name, _, attr = name.partition(":")
        key = f"reward.functions[{i}]={name!r}"
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise InputError(f"{key}: cannot import module {module_name!r} ({e})") from None
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise InputError(f"{key}: module {module_name!r} has no callable {attr!r}")
        fn = _bind(fn, dict(kwargs[i]), f"reward.kwargs[{i}]={dict(kwargs[i])!r} of {name}")
        out.append(RewardFunction(name, fn, float(weight)))
    return out


def call(f: RewardFunction, prompt: str, response: str, record: dict, where: str, skip: bool):
    """``f(prompt, response, record)`` as a float. A raise, or a value that is not a finite
    number, is a ``RewardFunctionError`` naming ``f`` and ``where`` (the record); with ``skip``
    a non-finite value is returned (with a warning) for the step's non-finite guard instead."""
    try:
        value = f.fn(prompt, response, record)
    except Exception as e:
        raise RewardFunctionError(
            f"reward function {f.name} raised {type(e).__name__}: {e} (on {where}; "
            f"response {response[:60]!r})"
        ) from e
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise RewardFunctionError(
            f"reward function {f.name} returned {type(value).__name__} {value!r}, not a float "
            f"(on {where})"
        )
    value = float(value)
    if not math.isfinite(value):
        message = f"reward function {f.name} returned {value} (on {where})"
        if not skip:
            raise RewardFunctionError(f"{message}; reward.nonfinite=skip passes it to the guard")
        warnings.warn(
            f"{message}: the step's update is skipped (reward.nonfinite=skip)", stacklevel=2
        )
    return value
