"""Test session setup: offline Flower settings for every test (helpers live in ``helpers.py``)."""

from fedsim.config import flower_env

flower_env()
