"""What runs in mingpt-torchrun's agent and on the launching node, and what mingpt-rendezvous serves. It reaches the
workers' side (mingpt.training) only through its entry points: the app's configuration and data preparation."""
