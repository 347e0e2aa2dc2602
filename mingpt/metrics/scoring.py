"""Multiple-choice examples scored by a GPT as lm-evaluation-harness scores its `multiple_choice` tasks
(lm_eval/api/task.py, `process_results`; lm_eval/models/huggingface.py, `_encode_pair` and `_loglikelihood_tokens`):
a choice's score is the sum of the log-probabilities of its tokens as the continuation " " + choice of the query,
the query cut on the left to fit the block; `acc_norm` divides it by len(choice) in characters, as the harness does.
See docs/evaluation.md (The score)."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mingpt.errors import TokenizerError
from mingpt.metrics.hellaswag import Example
from mingpt.model import GPT
from mingpt.tokenizers import Tokenizer


@dataclass(frozen=True)
class Encoded:
    """One example in tokens: each choice's window (inputs and the last target) and how many tokens at its end it is."""

    windows: tuple[tuple[int, ...], ...]
    continuation_tokens: tuple[int, ...]
    lengths: tuple[int, ...]  # characters of each choice, acc_norm's divisor
    label: int
    index: int = 0  # the example's place in its file


@dataclass(frozen=True)
class Scored:
    """One example's scores: the sum of log-probabilities of each choice, and that sum per character."""

    logprobs: tuple[float, ...]
    normalised: tuple[float, ...]
    label: int
    index: int

    @property
    def choice(self) -> int:
        return _first_max(self.logprobs)

    @property
    def choice_norm(self) -> int:
        return _first_max(self.normalised)


def _first_max(values: tuple[float, ...]) -> int:
    """The index of the largest value, the first of equal ones (numpy's argmax, which lm-evaluation-harness uses)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


@dataclass
class Tally:
    """Examples scored, and how many of them the model got right by each measure."""

    correct: int = 0
    correct_norm: int = 0
    count: int = 0

    def add(self, scored: Scored) -> None:
        self.correct += scored.choice == scored.label
        self.correct_norm += scored.choice_norm == scored.label
        self.count += 1

    @property
    def acc(self) -> float:
        return self.correct / self.count if self.count else float("nan")

    @property
    def acc_norm(self) -> float:
        return self.correct_norm / self.count if self.count else float("nan")


def encode(example: Example, tokenizer: Tokenizer, block_size: int, index: int = 0) -> Encoded | None:
    """`example` in tokens for `block_size` positions; None where a text will not encode or a choice overflows."""
    windows, continuations = [], []
    try:
        query = tokenizer.encode(example.query)
        for choice in example.choices:
            whole = tokenizer.encode(example.query + " " + choice)
            continuation = whole[len(query):]
            if not continuation or len(continuation) > block_size:
                return None
            windows.append(tuple((query + continuation)[-(block_size + 1):]))
            continuations.append(len(continuation))
    except TokenizerError:
        return None
    return Encoded(tuple(windows), tuple(continuations), tuple(len(c) for c in example.choices), example.label, index)


def encode_all(examples: list[Example], tokenizer: Tokenizer, block_size: int) -> tuple[list[Encoded], int]:
    """The examples that can be scored, in tokens, and how many cannot (see `encode`)."""
    encoded = [encode(example, tokenizer, block_size, index) for index, example in enumerate(examples)]
    kept = [e for e in encoded if e is not None]
    return kept, len(encoded) - len(kept)


def skipped_note(skipped: int, total: int, tokenizer: Tokenizer) -> str:
    """Why `skipped` of `total` examples are not scored (encode_all's count), in words."""
    return (f"{skipped} of {total} examples skipped: their text has characters the tokenizer "
            f"({tokenizer.describe()}) cannot encode, or an ending longer than the block")


@torch.no_grad()
def score(model: GPT, batch: list[Encoded], device: torch.device, autocast=None) -> list[Scored]:
    """The scores of a batch of examples, all choices in one forward pass (right padding, unseen by a causal model)."""
    windows = [window for example in batch for window in example.windows]
    longest = max(len(window) - 1 for window in windows)
    tokens = torch.zeros((len(windows), longest), dtype=torch.long)
    for row, window in enumerate(windows):
        tokens[row, : len(window) - 1] = torch.tensor(window[:-1])
    with autocast or nullcontext():
        logits, _ = model(tokens.to(device))
    rows = []
    for row, (window, count) in enumerate(zip(windows, (n for e in batch for n in e.continuation_tokens))):
        end = len(window) - 1
        logprobs = F.log_softmax(logits[row, end - count : end].float(), dim=-1)
        targets = torch.tensor(window[-count:], device=logprobs.device)
        rows.append(logprobs.gather(1, targets[:, None]).sum())
    sums = torch.stack(rows).tolist()  # one copy from the device for the batch
    scored, first = [], 0
    for example in batch:
        mine = tuple(sums[first : first + len(example.windows)])
        first += len(example.windows)
        normalised = tuple(s / max(n, 1) for s, n in zip(mine, example.lengths))
        scored.append(Scored(mine, normalised, example.label, example.index))
    return scored
