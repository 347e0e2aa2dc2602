"""The data a job trains on (with model.init_from's tokenizer where data.tokenizer is left at its default); the
launcher imports this module rather than the trainer, whose imports an agent does not need."""

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
    """The prepared folder of `cfg.data` (mingpt-torchrun's, before its node joins: the job never waits for it)."""
    if pretrained is None and cfg.model.init_from:
        pretrained = open_pretrained(cfg.model.init_from, cfg.data.block_size)
    return prepare(replace(cfg.data, tokenizer=_tokenizer(cfg, pretrained)))


def fetch_hellaswag(t: TrainerConfig) -> str | None:
    """Read the HellaSwag file before the workers start, so a wrong file fails here and a URL is fetched once a node,
    not in a start-up peers wait on. For the workers: "cached", "unavailable" (no metric), or None (a local file)."""
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
    default = type(cfg.data)().tokenizer
    if pretrained is None or cfg.data.tokenizer != default:
        return cfg.data.tokenizer
    if leads_this_generation():
        log.info("data.tokenizer: the tokenizer of model.init_from (%s)", pretrained.tokenizer)
    return pretrained.tokenizer
