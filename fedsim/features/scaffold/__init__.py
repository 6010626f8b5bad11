"""SCAFFOLD (Karimireddy et al., ICML 2020): the server strategy and the clients' algorithm with their control variates."""
