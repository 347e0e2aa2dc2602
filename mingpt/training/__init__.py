"""Training: the job's configuration, the elastic loop and its parts, and the process group it runs in."""
