"""mingpt: a GPT, its tokenizers and data, and an elastic fault-tolerant DDP trainer. The names below are imported on
first use, so that a command that needs none of them (mingpt-prepare, a tokenizing worker) starts without torch."""

from importlib import import_module

__version__ = "0.1.0"

_WHERE = {
    "GPT": "mingpt.model", "GPTConfig": "mingpt.shape", "PRESETS": "mingpt.shape",
    "Tokenizer": "mingpt.tokenizers", "train_tokenizer": "mingpt.tokenizers", "load_tokenizer": "mingpt.tokenizers",
    "prepare": "mingpt.data.prepare", "PrepareConfig": "mingpt.data.prepare",
    "PreparedData": "mingpt.data.prepared", "TokenBlocks": "mingpt.data.prepared",
    "MinGPTError": "mingpt.errors", "ConfigError": "mingpt.errors", "DataError": "mingpt.errors",
    "TokenizerError": "mingpt.errors",
}

__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'mingpt' has no attribute {name!r}")
    return getattr(import_module(_WHERE[name]), name)
