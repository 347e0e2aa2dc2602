"""How a replica that joins a live job gets the state from a live peer: torchft's checkpoint transport, over HTTP,
in a format that cannot run code and with every tensor checked.

torchft's own transports unpickle what a peer sends: any process that can reach the port could run code in the joiner.
Here the state travels as safetensors, each tensor with the sha256 the sender computed. On a mismatch the receiver
refuses the whole state (HealingError) and asks the step's other groups, which serve the same state (`offer`); where
none sends a sound one, the step fails, and the joiner heals again at the next."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import torch
from safetensors.torch import load as load_safetensors, save as save_safetensors
from torchft.checkpointing.transport import CheckpointTransport

from mingpt.checkpoint.packing import pack, unpack
from mingpt.storage import parse_json

log = logging.getLogger(__name__)

MAX_DESCRIPTION_BYTES = 64 << 20  # the JSON description of a state (tensors travel apart)
ASKED = 8  # other groups a healer asks, where its source's state does not check out
ASK_TIMEOUT = timedelta(seconds=2)  # ... each given this long to answer (a dead host's address never does)


class HealingError(RuntimeError):
    """The state a peer sent is not the state it described: cut short, damaged or not a state at all."""


def encode(state: Any) -> bytes:
    """`state` as safetensors: each tensor once, under its index; in the metadata the rest and every tensor's sha256."""
    tensors: list[torch.Tensor] = []
    tree = pack(state, tensors, shared={})
    named = {str(i): tensor.detach().cpu().contiguous() for i, tensor in enumerate(tensors)}
    digests = {name: _digest(tensor) for name, tensor in named.items()}
    return save_safetensors(named, metadata={"tree": json.dumps(tree), "sha256": json.dumps(digests)})


def decode(data: bytes) -> Any:
    """The state `encode` wrote, once every tensor matches its sha256; HealingError otherwise."""
    try:
        tensors = load_safetensors(data)
        metadata = _metadata(data)
        tree, digests = parse_json(metadata["tree"]), parse_json(metadata["sha256"])
    except HealingError:
        raise
    except Exception as e:  # safetensors' own errors, a missing key, JSON that is not
        raise HealingError(f"not a state ({type(e).__name__}: {e})") from None
    if set(digests) != set(tensors) or set(tensors) != {str(i) for i in range(len(tensors))}:
        raise HealingError("the state's tensors are not those it describes")
    bad = sorted(name for name, tensor in tensors.items() if _digest(tensor) != digests[name])
    if bad:
        raise HealingError(f"{len(bad)} of {len(tensors)} tensor(s) do not match the sha256 their sender computed")
    try:
        return unpack(tree, [tensors[str(i)] for i in range(len(tensors))])
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:  # a description not of ours
        raise HealingError(f"not a state (its description does not fit: {type(e).__name__})") from None


def _metadata(data: bytes) -> dict:
    """safetensors' header metadata: an 8-byte length, then JSON."""
    size = int.from_bytes(data[:8], "little")
    if not 0 < size <= MAX_DESCRIPTION_BYTES:
        raise HealingError("not a state (its header is missing or too large)")
    return parse_json(data[8:8 + size])["__metadata__"]


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.reshape(-1).view(torch.uint8).numpy()).hexdigest() if tensor.numel() else \
        hashlib.sha256(b"").hexdigest()


class VerifiedTransport(CheckpointTransport):
    """torchft's checkpoint transport, as `encode` and `decode` above, served over HTTP on `host`.
    A source serves one step's state between `send_checkpoint` and `disallow_checkpoint` (which waits for the
    transfers under way: the state may change once it returns); every other group of the step serves it too, made
    when first asked, from `offer`. `peers()` gives the addresses a healer asks when its source's state is refused."""

    def __init__(self, host: str, timeout: timedelta, peers: Callable[[], list[str]] = lambda: []):
        self.host, self.timeout, self.peers = host, timeout, peers
        self._lock = threading.Condition()
        self._served: tuple[int, bytes] | None = None  # (step, payload) while allowed
        self._offered: tuple[int, Callable[[], Any]] | None = None  # (step, its state, made when asked)
        self._sending = 0  # transfers under way
        transport = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                transport._handle(self)

            def log_message(self, format: str, *args) -> None:  # noqa: A002 (BaseHTTPRequestHandler's name)
                log.debug("healing: " + format, *args)

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="healing-server", daemon=True)
        self._thread.start()

    def metadata(self) -> str:
        return f"http://{self.host}:{self._server.server_address[1]}/checkpoint/"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        payload = encode(state_dict)
        with self._lock:
            self._served = (step, payload)
            self._lock.notify_all()
        log.info("healing: serving step %d (%.1f MB) to %d replica(s)", step, len(payload) / 1e6, len(dst_ranks))

    def offer(self, step: int, state: Callable[[], Any]) -> None:
        """This group is at `step` until `disallow_checkpoint`: serve `state()` to a healer that asks."""
        with self._lock:
            self._offered = (step, state)
            self._lock.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._lock:
            self._served = self._offered = None
            self._lock.wait_for(lambda: self._sending == 0, timeout=self.timeout.total_seconds())

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        """The state of `step` from the source torchft chose, or, where it does not check out, from another."""
        try:
            return self._fetch(metadata, step, timeout)
        except HealingError as refused:
            for peer in reversed(self.peers()[-ASKED:]):  # the newest first: the likeliest to be alive
                if peer in (metadata, self.metadata()):
                    continue
                try:
                    state = self._fetch(peer, step, min(timeout, ASK_TIMEOUT))
                except (HealingError, OSError):  # damaged too, or gone, or not at this step: the next one
                    continue
                log.info("healing: received step %d from %s instead", step, peer)
                return state
            raise refused

    def _fetch(self, metadata: str, step: int, timeout: timedelta) -> Any:
        url = f"{metadata}{step}"
        with urllib.request.urlopen(url, timeout=timeout.total_seconds()) as response:
            data = response.read()
        try:
            return decode(data)
        except HealingError as e:
            log.warning("healing: refused the state of step %d from %s: %s", step, url, e)
            raise

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join()

    def _handle(self, request: BaseHTTPRequestHandler) -> None:
        """GET .../checkpoint/STEP, once this source serves it (a healer may ask before the source has staged it)."""
        wanted = request.path.rsplit("/", 1)[-1]
        at = lambda held: held is not None and str(held[0]) == wanted
        with self._lock:
            self._lock.wait_for(lambda: at(self._served) or at(self._offered), timeout=self.timeout.total_seconds())
            if not at(self._served) and at(self._offered):  # made once, while the step's state stands still
                self._served = (self._offered[0], encode(self._offered[1]()))
            served = self._served
            if not at(served):
                request.send_error(404, f"not serving step {wanted}")
                return
            self._sending += 1
        try:
            payload = served[1]
            request.send_response(200)
            request.send_header("Content-Type", "application/octet-stream")
            request.send_header("Content-Length", str(len(payload)))
            request.end_headers()
            request.wfile.write(payload)
        finally:
            with self._lock:
                self._sending -= 1
                self._lock.notify_all()
