"""What the rendezvous tests' store wrappers share: the optional value-carrying watch.

A test wrapper around a store passes what it does not override to the store with
``__getattr__``. Python 3.12's ``isinstance`` on a ``runtime_checkable`` protocol looks a
member up statically (``inspect.getattr_static``), never through ``__getattr__``, so from
3.12 on such a wrapper lost :class:`flexrun.store.api.WatchesValues` and the handler behind
it ran the path of a store without value-carrying watches (as tcp) where 3.11 ran etcd's:
two tests failed on 3.12 only. :func:`forward_value_watches` puts the members on the
wrapper itself, each still going through the wrapper's ``__getattr__`` (which may count).
"""

from __future__ import annotations

from typing import Any

VALUE_WATCH = ("get_prefix_at", "watch_values")


def forward_value_watches(wrapper: Any, inner: Any) -> None:
    """Give ``wrapper`` the value-carrying watch of ``inner`` (where ``inner`` has it and the
    wrapper's class does not define the member itself)."""
    for name in VALUE_WATCH:
        if callable(getattr(inner, name, None)) and name not in dir(type(wrapper)):

            def forward(*args: Any, _name: str = name, **kw: Any) -> Any:
                return type(wrapper).__getattr__(wrapper, _name)(*args, **kw)

            wrapper.__dict__[name] = forward
