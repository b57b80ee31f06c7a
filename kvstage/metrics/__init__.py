"""What a run's trace says: per-room latencies and summary metrics (`rooms`), mean step
times (`steps`) and the bottleneck verdict (`bottleneck`)."""
