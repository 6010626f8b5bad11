"""FedDyn (Acar et al., ICLR 2021): the server strategy and the clients' dynamic regulariser."""
