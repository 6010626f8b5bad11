"""Personalised FL, Ditto and FedPer: the server strategies and the clients' personal models or layers."""
