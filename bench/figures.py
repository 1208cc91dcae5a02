"""The PNG side of every benchmark: matplotlib without a display, and one way to save."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display here), imported only when a plot
    is asked for: the benchmarks run without matplotlib otherwise."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: str | Path, dpi: int) -> None:
    """Lay out ``fig``, write it to ``path`` (making its folder) and free it."""
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
