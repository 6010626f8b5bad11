"""Client-side clipping: the client half of clipping and DP."""
