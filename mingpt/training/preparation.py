"""The data a job trains on: its prepared folder, tokenized with model.init_from's tokenizer where
data.tokenizer is left at its default.

Every worker calls `prepare_data`, and so does `mingpt-torchrun` before its node joins the job, after
`fetch_hellaswag` where the job scores HellaSwag. The launcher imports this module, not the trainer: an agent
needs none of the trainer's machinery (FSDP and DCP alone cost each agent about 0.7 s of CPU to import).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from mingpt.data.prepare import prepare
from mingpt.interop.pretrained import Pretrained, open_pretrained
from mingpt.jobenv import leads_this_generation
from mingpt.metrics import hellaswag
from mingpt.storage import redact
from mingpt.training.config import Config, TrainerConfig

log = logging.getLogger(__name__)
def prepare_data(cfg: Config, pretrained: Pretrained | None = None) -> Path:
    """The prepared folder of `cfg.data` (reused, or prepared now). mingpt-torchrun calls it before its
    node joins the job, so that the job never waits while a new node tokenizes."""
    if pretrained is None and cfg.model.init_from:
        pretrained = open_pretrained(cfg.model.init_from, cfg.data.block_size)
    return prepare(replace(cfg.data, tokenizer=_tokenizer(cfg, pretrained)))


def fetch_hellaswag(t: TrainerConfig) -> str | None:
    """Where the job scores HellaSwag (trainer.hellaswag_every), read its file on this node now, before the data
    work and before the workers start: a file that is not HellaSwag's is a MinGPTError here, and a URL is fetched
    into this machine's cache once for the node. What came of it, for the workers (mingpt.jobenv's
    hellaswag_fetched): "cached" (they read this copy instead of each fetching it again in the start-up their
    peers wait on), "unavailable" (it could not be had: they train without the metric after this one warning), or
    None (a local file: they read it)."""
    if not t.hellaswag_every:
        return None
    try:
        hellaswag.load_examples(t.hellaswag_data, "trainer.hellaswag_data")
    except hellaswag.HellaSwagUnavailable as e:
        log.warning("%s; training goes on without the HellaSwag metric", e)
        return "unavailable"
    if hellaswag.is_local(t.hellaswag_data):
        return None
    log.info("HellaSwag: %s is in this machine's cache (%s) for its workers", redact(t.hellaswag_data),
             hellaswag.cache_path(t.hellaswag_data).parent)
    return "cached"


def _tokenizer(cfg: Config, pretrained: Pretrained | None) -> str:
    """data.tokenizer, or the tokenizer of model.init_from where data.tokenizer is left at its default."""
    default = type(cfg.data)().tokenizer
    if pretrained is None or cfg.data.tokenizer != default:
        return cfg.data.tokenizer
    if leads_this_generation():
        log.info("data.tokenizer: the tokenizer of model.init_from (%s)", pretrained.tokenizer)
    return pretrained.tokenizer
