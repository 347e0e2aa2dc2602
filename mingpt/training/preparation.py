"""The data a job trains on: its prepared folder, tokenized with model.init_from's tokenizer where
data.tokenizer is left at its default.

Every worker calls `prepare_data`, and so does `mingpt-torchrun` before its node joins the job, with
`fetch_hellaswag` where the job scores HellaSwag from a URL. The
launcher imports this module, not the trainer: an agent needs none of the trainer's machinery (FSDP and
DCP alone cost each agent about 0.7 s of CPU to import).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from mingpt.data.prepare import prepare
from mingpt.interop.pretrained import Pretrained, open_pretrained
from mingpt.metrics import hellaswag
from mingpt.storage import redact
from mingpt.training.config import Config, TrainerConfig
from mingpt.training.distributed import leads_this_generation

log = logging.getLogger(__name__)


def prepare_data(cfg: Config, pretrained: Pretrained | None = None) -> Path:
    """The prepared folder of `cfg.data` (reused, or prepared now). mingpt-torchrun calls it before its
    node joins the job, so that the job never waits while a new node tokenizes."""
    if pretrained is None and cfg.model.init_from:
        pretrained = open_pretrained(cfg.model.init_from, cfg.data.block_size)
    return prepare(replace(cfg.data, tokenizer=_tokenizer(cfg, pretrained)))


def fetch_hellaswag(t: TrainerConfig) -> None:
    """Where the job scores HellaSwag from a URL (trainer.hellaswag_every, trainer.hellaswag_data), fetch it into
    this machine's cache now, so that the workers read that copy instead of each fetching it in the start-up their
    peers wait on. Where it cannot be had, one warning: the workers try once more, then train without the metric.
    A file that cannot be HellaSwag's (too large; not the known file at its public URL) is a MinGPTError here."""
    if not t.hellaswag_every or hellaswag.is_local(t.hellaswag_data):
        return
    try:
        hellaswag.cached_copy(t.hellaswag_data)
    except hellaswag.HellaSwagUnavailable as e:
        log.warning("%s", e)
        return
    log.info("HellaSwag: %s is in this machine's cache (%s) for its workers", redact(t.hellaswag_data),
             hellaswag.cache_path(t.hellaswag_data).parent)


def _tokenizer(cfg: Config, pretrained: Pretrained | None) -> str:
    """data.tokenizer, or the tokenizer of model.init_from where data.tokenizer is left at its default."""
    default = type(cfg.data)().tokenizer
    if pretrained is None or cfg.data.tokenizer != default:
        return cfg.data.tokenizer
    if leads_this_generation():
        log.info("data.tokenizer: the tokenizer of model.init_from (%s)", pretrained.tokenizer)
    return pretrained.tokenizer
