"""The control plane: the run secret, keys, signed frames and the rendezvous."""
