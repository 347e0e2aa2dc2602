"""What runs in mingpt-torchrun's agent and on the launching node: the checks before joining, the agent and its
watchdog, the warm-worker server, the live mode's launching side, and what mingpt-rendezvous serves. It reaches the
workers' side (mingpt.training) only through its entry points: the app's configuration and data preparation."""
