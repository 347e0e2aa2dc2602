"""Data: corpus sources, preparation into token files, reading them back, and the order examples are read in."""
