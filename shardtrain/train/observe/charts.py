"""What every chart of `shardtrain report` shares: matplotlib without a display, and an
atomic write of the PNG (a reader never sees half a file)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from shardtrain.config import ConfigError


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or a ConfigError naming the extra to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("shardtrain report draws with matplotlib, which is not installed: "
                          "pip install 'shardtrain[plot]'") from None
    return plt


def save_png(fig: Any, path: Path) -> None:
    """Write `fig` to `path` through a temporary file and a rename; closes the figure."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fig.savefig(tmp, format="png", dpi=110)
    pyplot().close(fig)
    os.replace(tmp, path)
