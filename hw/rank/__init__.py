"""A rank process of hardware mode: its loop, the prefill and decode sides, their memory and kernels."""
