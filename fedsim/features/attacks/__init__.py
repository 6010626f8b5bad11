"""Byzantine clients (``attack=``): the server's wrappers and label flipping's client half."""
