"""mingpt: a GPT, its tokenizers and data, and an elastic fault-tolerant DDP trainer."""

from mingpt.data import PreparedData, TokenBlocks, prepare
from mingpt.errors import ConfigError, DataError, MinGPTError, TokenizerError
from mingpt.model import GPT, PRESETS, GPTConfig
from mingpt.tokenizers import Tokenizer, load_tokenizer, train_tokenizer

__version__ = "0.1.0"

__all__ = [
    "GPT", "GPTConfig", "PRESETS", "Tokenizer", "train_tokenizer", "load_tokenizer",
    "prepare", "PreparedData", "TokenBlocks", "MinGPTError", "ConfigError", "DataError", "TokenizerError",
]
