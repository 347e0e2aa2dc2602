"""Metrics: where the trainer's records go (metrics.jsonl, TensorBoard, W&B), and reading them back for a plot."""
