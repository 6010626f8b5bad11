"""Describe a partition: per-client sizes and label histograms, and a stacked-bar picture of them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["label_entropy", "partition_stats", "plot_partitions"]


def label_entropy(counts: np.ndarray) -> np.ndarray:
    """Entropy in bits of each row of a label-count matrix (0 for an empty row).

    Parameters
    ----------
    counts : np.ndarray
        Non-negative counts, shape ``(clients, classes)``.

    Returns
    -------
    np.ndarray
        Shape ``(clients,)``; ``log2(classes)`` for a uniform row, 0 for a single-class row.
    """
    counts = np.asarray(counts, dtype=np.float64)
    totals = counts.sum(axis=1, keepdims=True)
    p = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
    logp = np.log2(p, out=np.zeros_like(p), where=p > 0)
    return -(p * logp).sum(axis=1)


def partition_stats(parts: list[np.ndarray], labels: np.ndarray, num_classes: int) -> dict:
    """Per-client sizes and label histograms, plus a few summary numbers; JSON-serialisable.

    Parameters
    ----------
    parts : list of np.ndarray
        One index array per client, as returned by a partitioner.
    labels : np.ndarray
        Class id of every training example, in ``[0, num_classes)``.
    num_classes : int
        Number of classes.

    Returns
    -------
    dict
        ``sizes`` (list, one int per client), ``label_counts`` (list of per-client lists of length
        ``num_classes``), ``num_clients``, ``num_classes``, ``num_examples``, ``size_min``, ``size_max``,
        ``size_mean``, ``size_std``, ``mean_label_entropy`` (bits) and ``mean_classes_per_client``.
    """
    labels = np.asarray(labels)
    sizes = np.array([len(p) for p in parts], dtype=np.int64)
    k = sizes.size
    if k == 0:
        raise ValueError("parts is empty: a partition has at least one client")
    idx = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
    y = labels[idx].astype(np.int64)
    if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}), got [{y.min()}, {y.max()}]")
    owner = np.repeat(np.arange(k), sizes)
    counts = np.bincount(owner * num_classes + y, minlength=k * num_classes).reshape(k, num_classes)
    return {
        "num_clients": int(k),
        "num_classes": int(num_classes),
        "num_examples": int(sizes.sum()),
        "sizes": sizes.tolist(),
        "label_counts": counts.tolist(),
        "size_min": int(sizes.min()),
        "size_max": int(sizes.max()),
        "size_mean": float(sizes.mean()),
        "size_std": float(sizes.std()),
        "mean_label_entropy": float(label_entropy(counts).mean()),
        "mean_classes_per_client": float((counts > 0).sum(axis=1).mean()),
    }


def plot_partitions(stats: dict, path: str | Path, max_clients: int = 100) -> Path:
    """Draw each client's label counts as one stacked horizontal bar and save a PNG.

    Uses matplotlib's object API with the Agg canvas, so pyplot's global state and backend are untouched.

    Parameters
    ----------
    stats : dict
        Output of :func:`partition_stats`.
    path : str or Path
        Where to write the PNG; parent folders are created.
    max_clients : int
        Show at most this many clients (the first ones); the title says how many there are.

    Returns
    -------
    Path
        The file written.
    """
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    counts = np.asarray(stats["label_counts"], dtype=np.int64)
    k, num_classes = counts.shape
    shown = counts[:max_clients]
    fig = Figure(figsize=(8, max(3.0, 1.5 + 0.12 * len(shown))))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    cmap = colormaps["tab10" if num_classes <= 10 else "tab20"]
    rows = np.arange(len(shown))
    left = np.zeros(len(shown))
    for c in range(num_classes):
        ax.barh(rows, shown[:, c], left=left, height=0.85, color=cmap(c % cmap.N), label=str(c))
        left += shown[:, c]
    ax.set_ylim(len(shown) - 0.5, -0.5)  # client 0 on top
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("examples")
    ax.set_ylabel("client")
    title = f"Label counts per client ({k} clients"
    title += f", first {len(shown)} shown)" if len(shown) < k else ")"
    ax.set_title(title)
    if num_classes <= 20:
        ax.legend(title="class", loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
