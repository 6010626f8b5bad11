"""Data: builders that return a :class:`Dataset`, partitioners (:mod:`fedsim.data.partition`) and stats.

Builders read bundled or generated data (``digits``, ``synthetic``, ...), files in known layouts (``vision``),
anything Hugging Face ``datasets`` reads (:mod:`fedsim.data.hf`, ``dataset=hf``) and a user's own arrays
(:mod:`fedsim.data.npz`, ``dataset=npz``).
"""

from fedsim.data.base import Dataset
from fedsim.data.partition import split_train_val
from fedsim.data.stats import partition_stats, plot_partitions

__all__ = ["Dataset", "partition_stats", "plot_partitions", "split_train_val"]
