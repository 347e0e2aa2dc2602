"""Errors the library raises for bad input.

Each message says what is wrong and what to do about it; the command-line
entry points print the message alone, without a traceback.
"""


class MinGPTError(Exception):
    """Base class for every error caused by user input or stored data."""


class ConfigError(MinGPTError, ValueError):
    """A configuration value is missing, of the wrong type, or out of range."""


class DataError(MinGPTError, ValueError):
    """A corpus or a prepared data folder is missing, empty, too short or damaged."""


class TokenizerError(MinGPTError, ValueError):
    """A tokenizer cannot be built, loaded, or cannot encode the given text."""


class TrainingError(MinGPTError):
    """Training cannot go on as configured (for example, the loss became infinite or NaN)."""
