"""The fast tier and the cases of a parametrized test it leaves to the full run.

``make test-fast`` runs ``pytest -m "not slow"``: a test marked ``slow`` is one that is slow by nature
(it traces or trains a real model, starts processes, or plans and simulates a large cluster). Where a
test is a grid of cases, ``slow_where`` keeps a spread of them in the fast tier and marks the rest::

    @pytest.mark.parametrize("plan", slow_where(twin_plans(), one_in(6)), ids=...)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest


def slow_where(cases: Iterable[Any], where: Callable[[int, Any], bool],
               ids: Callable[[Any], str] | None = None) -> list[Any]:
    """``cases`` as parameters of ``pytest.mark.parametrize``, marked ``slow`` where ``where(index, case)`` holds.

    A case that is a tuple gives one value per argument name; ``ids`` names a case (else pytest's own ids).
    """
    out = []
    for k, case in enumerate(cases):
        values = case if isinstance(case, tuple) else (case,)
        marks = (pytest.mark.slow,) if where(k, case) else ()
        out.append(pytest.param(*values, marks=marks, id=None if ids is None else ids(case)))
    return out


def one_in(every: int) -> Callable[[int, Any], bool]:
    """``where`` for ``slow_where``: every ``every``-th case (the first among them) stays in the fast tier."""
    return lambda k, _case: k % every != 0
