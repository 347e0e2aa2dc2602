"""HellaSwag during training (`trainer.hellaswag_every`): the examples, read and tokenized once per start, scored
by every process together, in fixed batches by their place in the file, so that any world size gives the same
accuracy on the same weights."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable

from mingpt.data.sampler import micro_batches, shard
from mingpt.jobenv import JobEnv
from mingpt.metrics.hellaswag import Example, HellaSwagUnavailable, load_examples
from mingpt.metrics.scoring import Encoded, Tally, encode_all, score, skipped_note
from mingpt.model import GPT
from mingpt.storage import redact
from mingpt.tokenizers import Tokenizer
from mingpt.training import distributed
from mingpt.training.config import TrainerConfig
from mingpt.training.parallel import Topology

log = logging.getLogger(__name__)


@dataclass
class HellaSwag:
    """The examples this job scores, in tokens, and how many go in one forward pass."""
    examples: list[Encoded]
    batch_examples: int

    def score(self, model: GPT, topology: Topology, autocast, tick: Callable[[], None] = lambda: None) -> Tally:
        """A sharded model's forward is a collective: every process runs as many batches as the most, extras weigh 0."""
        world = topology.world
        batches = micro_batches(len(self.examples), self.batch_examples)
        mine = batches[shard(len(batches), world.world_size, world.rank)]
        runs = math.ceil(len(batches) / world.world_size) if topology.sharded else len(mine)
        tally = Tally()
        model.eval()
        for i in range(runs):
            batch = mine[i] if i < len(mine) else batches[0]
            for scored in score(model, self.examples[batch], world.device, autocast):
                if i < len(mine):
                    tally.add(scored)
            tick()
        model.train()
        correct, correct_norm, count = distributed.all_reduce_sum([tally.correct, tally.correct_norm, tally.count],
                                                                   world)
        return Tally(round(correct), round(correct_norm), round(count))


def read_hellaswag(t: TrainerConfig, job: JobEnv) -> list[Example] | None:
    """Read before the data work, so a file that is not HellaSwag's stops the job at once; None, with one warning,
    where it cannot be had (under mingpt-torchrun the agent fetched it already: preparation.fetch_hellaswag)."""
    if not t.hellaswag_every:
        return None
    agent_found = job.hellaswag_fetched
    if agent_found == "unavailable":
        return None
    try:
        return load_examples(t.hellaswag_data, "trainer.hellaswag_data", fetch=agent_found is None)
    except HellaSwagUnavailable as e:
        if job.rank == 0:  # before the process group exists: the future leader
            log.warning("%s; training goes on without the HellaSwag metric", e)
        return None


def load_hellaswag(t: TrainerConfig, examples: list[Example] | None, tokenizer: Tokenizer, block_size: int,
                   job: JobEnv) -> HellaSwag | None:
    """`examples` in tokens, with the number scored in one forward pass; None where none can be scored."""
    if not examples:
        return None
    encoded, skipped = encode_all(examples, tokenizer, block_size)
    if skipped and job.rank == 0:  # before the process group exists: the future leader
        log.warning("HellaSwag, %s: %s", redact(t.hellaswag_data), skipped_note(skipped, len(examples), tokenizer))
    return HellaSwag(encoded, max(1, t.micro_batch_size // 4)) if encoded else None


def agree(hellaswag: HellaSwag | None, world: distributed.World, speaks: bool) -> HellaSwag | None:
    """`hellaswag` where every process has as many examples, else None for all: the scoring is a collective."""
    have = [1.0, len(hellaswag.examples)] if hellaswag else [0.0, 0.0]
    processes, examples = distributed.all_reduce_sum(have, world)
    if processes == world.world_size and examples == world.world_size * have[1]:
        return hellaswag
    if speaks and processes:
        log.warning("HellaSwag: %d of %d processes have its examples, or they differ in number; training goes on "
                    "without the HellaSwag metric: give every node the same trainer.hellaswag_data",
                    processes, world.world_size)
    return None
