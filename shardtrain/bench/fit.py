"""Fitting the alpha-beta-gamma model to measured collective times, and predicting with it.

The cost model (comm/cost.py) is linear in the link figures for the algorithms whose phases
do not depend on them: time = R alpha + B beta + G gamma + T shared, where R (rounds), B
(bytes on the critical path), G (bytes reduced on it) and T (bytes all ranks send) are read
off the model by pricing the call on unit links. On one host T is what costs: the ranks
share its memory and cores, and the fit says so (beta near 0, shared the host's inverse
bandwidth). The fit minimises the squared *relative* error over all measured calls of those
algorithms (so 1 KiB and 256 MiB count alike), with every coefficient kept >= 0.
`hierarchical` and `auto` pick their phases by price, so they are predicted, never fitted;
`native` is the backend's own algorithm, which the model only approximates (as a ring).
"""

from __future__ import annotations

import numpy as np

from shardtrain.comm import cost

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


def fit(rows: list[dict], p: int, local_size: int) -> cost.Link:
    """Least squares of relative error; rows: {"op", "algorithm", "bytes", "time_s"}."""
    x, y = [], []
    for row in rows:
        t = terms(row["op"], row["algorithm"], row["bytes"], p, local_size)
        if t is not None and row["time_s"] > 0:
            x.append([v / row["time_s"] for v in t])
            y.append(1.0)
    x, y = np.array(x), np.array(y)
    keep = [0, 1, 2, 3]
    while True:  # non-negative least squares by elimination (4 unknowns)
        solution = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        if (solution >= 0).all():
            break
        keep.pop(int(np.argmin(solution)))
    figures = [0.0] * 4
    for k, v in zip(keep, solution):
        figures[k] = float(v)
    return cost.Link.from_figures(figures)


def predict(op: str, algorithm: str, nbytes: int, p: int, link: cost.Link,
            local_size: int) -> float | None:
    """Modelled seconds (None where the model has no such algorithm for this call)."""
    if algorithm == "auto":
        algorithm = cost.best_algorithm(op, nbytes, p, link, local_size=local_size, native=True)
    try:
        return cost.cost(op, nbytes, p, link, algorithm=algorithm, local_size=local_size).time_s
    except ValueError:
        return None
