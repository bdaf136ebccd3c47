"""Fitting the alpha-beta-gamma model to measured collective times, and predicting with it.

The cost model (cost/collectives.py) is linear in the link figures for the algorithms whose phases
do not depend on them: time = R alpha + B beta + G gamma + T shared, where R (rounds), B
(bytes on the critical path), G (bytes reduced or copied locally on it) and T (bytes all
ranks send) are read off the model by pricing the call on unit links. On one host T is
what costs: the ranks share its memory and cores, and the fit says so (beta near 0, shared
the host's inverse bandwidth). The fit minimises the squared *relative* error over all
measured calls of those algorithms (so 1 KiB and 256 MiB count alike), with every
coefficient kept >= 0.
`hierarchical` and `auto` pick their phases by price, so they are predicted, never fitted.

`native`, the backend's own algorithm, gets figures of its own, fitted the same way from
its calls once the shared ones are known, with the model of that backend's collectives
(cost.py): its latency per round (its messages are sent from C++, ours from Python) and
the time per byte of the fresh temporaries it stages through, time = R native_alpha +
F staging + (the rest at the shared figures).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from shardtrain.cost import collectives as cost

FITTED = ("ring", "tree", "recursive_doubling", "halving_doubling", "rabenseifner", "torus2d")
_UNIT = tuple(cost.Link.from_figures(row) for row in np.eye(4))  # alpha, beta, gamma, shared


def terms(op: str, algorithm: str, nbytes: int, p: int, local_size: int) -> tuple | None:
    """(R, B, G, T) of one call, or None where the model does not price it linearly."""
    if algorithm not in FITTED:
        return None
    try:
        return tuple(cost.cost(op, nbytes, p, unit, algorithm=algorithm,
                               local_size=local_size).time_s for unit in _UNIT)
    except ValueError:  # e.g. a torus on a prime number of ranks
        return None


def fit(rows: list[dict], p: int, local_size: int, backend: str) -> cost.Link:
    """Least squares of relative error; rows: {"op", "algorithm", "bytes", "time_s"}, timed
    on `backend`. The shared figures from our algorithms' rows, then native's from the
    backend's rows (native's latency is ours where the backend was not timed)."""
    x, y = [], []
    for row in rows:
        t = terms(row["op"], row["algorithm"], row["bytes"], p, local_size)
        if t is not None and row["time_s"] > 0:
            x.append([v / row["time_s"] for v in t])
            y.append(1.0)
    shared = _nonnegative(np.array(x), np.array(y)) if x else [0.0] * 4
    link = cost.Link.from_figures([*shared, 0.0, 0.0], backend)
    x, y = [], []  # native: R native_alpha + F staging = time - rest, relative to time
    for row in (r for r in rows if r["algorithm"] == "native" and r["time_s"] > 0):
        r, f, rest = _native_terms(row["op"], row["bytes"], p, link)
        x.append([r / row["time_s"], f / row["time_s"]])
        y.append(1.0 - rest / row["time_s"])
    native = _nonnegative(np.array(x), np.array(y)) if x else [shared[0], 0.0]
    return cost.Link.from_figures([*shared, *native], backend)


def _native_terms(op: str, nbytes: int, p: int, link: cost.Link) -> tuple[float, ...]:
    """(R, F, the rest at `link`'s shared figures) of the backend's own call: its form on
    `link.backend` is linear in native_alpha and staging."""
    def price(**figures) -> float:
        return cost.cost(op, nbytes, p, dataclasses.replace(link, **figures)).time_s

    rest = price(native_alpha_s=0.0, staging_s_per_byte=0.0)
    zero = dict(alpha_s=0.0, beta_s_per_byte=0.0, gamma_s_per_byte=0.0, shared_s_per_byte=0.0)
    return (price(**zero, native_alpha_s=1.0, staging_s_per_byte=0.0),
            price(**zero, native_alpha_s=0.0, staging_s_per_byte=1.0), rest)


def _nonnegative(x: np.ndarray, y: np.ndarray) -> list[float]:
    """argmin over v >= 0 of |x v - y|^2, by dropping the most negative unknown until
    none is (enough for the few unknowns here)."""
    keep = list(range(x.shape[1]))
    solution = np.zeros(0)
    while keep:
        solution = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        if (solution >= 0).all():
            break
        keep.pop(int(np.argmin(solution)))
    figures = [0.0] * x.shape[1]
    for k, v in zip(keep, solution):
        figures[k] = float(v)
    return figures


def predict(op: str, algorithm: str, nbytes: int, p: int, link: cost.Link,
            local_size: int) -> float | None:
    """Modelled seconds (None where the model has no such algorithm for this call)."""
    if algorithm == "auto":
        algorithm = cost.best_algorithm(op, nbytes, p, link, local_size=local_size, native=True)
    try:
        return cost.cost(op, nbytes, p, link, algorithm=algorithm, local_size=local_size).time_s
    except ValueError:
        return None
