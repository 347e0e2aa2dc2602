"""Snapshots of a run: the store (one folder per step, manifest last), its background writer, the
lease that makes one job the writer, and reading a trained model back."""
