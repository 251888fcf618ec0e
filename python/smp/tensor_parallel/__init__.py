"""Tensor parallelism: module marks, the inputs of a TP group, the shards put in the module."""
