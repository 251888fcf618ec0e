"""Data parallelism: replicas that start equal, and gradients averaged in buckets."""
