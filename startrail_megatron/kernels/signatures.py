"""Parameter names of a third-party function: how the flash-attn and TE adapters
detect which version of a private API they call."""

from __future__ import annotations

import inspect
from typing import Any


def param_names(fn: Any) -> tuple[tuple[str, ...], frozenset[str]]:
    """(parameter names, those without a default) of a function, custom op or torch op.

    ``torch.library.custom_op`` objects show ``(*args, **kwargs)``; their Python
    function is ``_init_fn``. A ``torch.ops`` packet or overload carries a schema.
    """
    target = getattr(fn, "_init_fn", None) or fn
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        sig = None
    var = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    if sig is not None and not any(p.kind in var for p in sig.parameters.values()):
        names = tuple(sig.parameters)
        required = frozenset(n for n, p in sig.parameters.items() if p.default is p.empty)
        return names, required
    schema = getattr(fn, "_schema", None)
    if schema is None and hasattr(fn, "default"):
        schema = getattr(fn.default, "_schema", None)
    if schema is not None:
        args = schema.arguments
        return tuple(a.name for a in args), frozenset(
            a.name for a in args if not a.has_default_value()
        )
    raise NotImplementedError(f"cannot read the parameters of {fn!r}")
