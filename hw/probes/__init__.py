"""The probes of `kvstage calibrate`: real engine processes timed on this machine
(`engine`: writes, batches, control, kernels, fill; `posting`: posting costs), on the
harness they share (`harness`: the children's set-up, bounded waits, one reaper)."""
