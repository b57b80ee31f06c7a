"""Many simulations at once: parameter sweeps and their target, capacity plans, the
parallel executor both run on, and their figures."""
