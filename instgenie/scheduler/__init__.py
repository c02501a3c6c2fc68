"""Request routing across GPU workers: latency cost models, routing policies, worker state."""
