"""Client selection (``selection=``): power of choice's wrapper and its loss probe's client half."""
