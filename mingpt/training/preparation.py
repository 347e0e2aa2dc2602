"""The data a job trains on: its prepared folder, tokenized with model.init_from's tokenizer where
data.tokenizer is left at its default.

Every worker calls `prepare_data`, and so does `mingpt-torchrun` before its node joins the job, after
`fetch_hellaswag` where the job scores HellaSwag. The launcher imports this module, not the trainer: an agent
needs none of the trainer's machinery (FSDP and DCP alone cost each agent about 0.7 s of CPU to import).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

from mingpt.data.prepare import prepare
from mingpt.interop.pretrained import Pretrained, open_pretrained
from mingpt.metrics import hellaswag
from mingpt.storage import redact
from mingpt.training.config import Config, TrainerConfig
from mingpt.training.distributed import leads_this_generation

log = logging.getLogger(__name__)
# What fetch_hellaswag, in mingpt-torchrun's agent, made of a URL for the node's workers: "cached" (read the copy in
# this machine's cache, fetch nothing) or "unavailable" (it warned: train without the metric).
HELLASWAG_FETCHED = "MINGPT_HELLASWAG_FETCHED"


def prepare_data(cfg: Config, pretrained: Pretrained | None = None) -> Path:
    """The prepared folder of `cfg.data` (reused, or prepared now). mingpt-torchrun calls it before its
    node joins the job, so that the job never waits while a new node tokenizes."""
    if pretrained is None and cfg.model.init_from:
        pretrained = open_pretrained(cfg.model.init_from, cfg.data.block_size)
    return prepare(replace(cfg.data, tokenizer=_tokenizer(cfg, pretrained)))


def fetch_hellaswag(t: TrainerConfig) -> None:
    """Where the job scores HellaSwag (trainer.hellaswag_every), read its file on this node now, before the data
    work and before the workers start: a file that is not HellaSwag's is a MinGPTError here, and a URL is fetched
    into this machine's cache once for the node. HELLASWAG_FETCHED tells the workers what came of it: they read
    this copy instead of each fetching it again in the start-up their peers wait on, or, where it could not be
    had, train without the metric after this one warning."""
    if not t.hellaswag_every:
        return
    try:
        hellaswag.load_examples(t.hellaswag_data, "trainer.hellaswag_data")
    except hellaswag.HellaSwagUnavailable as e:
        log.warning("%s; training goes on without the HellaSwag metric", e)
        os.environ[HELLASWAG_FETCHED] = "unavailable"
        return
    if not hellaswag.is_local(t.hellaswag_data):
        os.environ[HELLASWAG_FETCHED] = "cached"
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
