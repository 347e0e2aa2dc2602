"""Training: the job's configuration, the elastic loop and its components (checkpointing, precision,
performance, schedule), and the process group it runs in."""
