"""Seeded fault injection (``faults=``): a client half only; the server sees the failures in its reply screen."""
