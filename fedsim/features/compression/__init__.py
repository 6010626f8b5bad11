"""Compression of client updates (``compression=``): the server's wrappers and the client's encoder."""
