"""A real S3 server on 127.0.0.1 (moto's), behind a middleware that injects faults on request.

The middleware can answer chosen requests with an S3 error (503 SlowDown, ...), cut their
connection, hold them until released (to kill a client mid-upload), delay them (slow storage), or reject requests signed
with another access key (403 InvalidAccessKeyId, as S3 does for wrong credentials).
"""

from __future__ import annotations

import re
import socket
import threading
import time
from dataclasses import dataclass, field

from moto.server import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import make_server

ACCESS_KEY = "AKIAMINGPTTESTKEY"
SECRET_KEY = "mingpt-test-secret-do-not-log"
REGION = "us-east-1"


@dataclass
class Rule:
    method: str
    pattern: str  # regex searched in the request path
    action: str  # "error", "cut", "hold" or "delay"
    count: float = 1  # how many matching requests it applies to (inf: all)
    delay_s: float = 0.0  # "delay": how long each waits (under the client's read timeout, or it retries)
    status: int = 503
    code: str = "SlowDown"
    hits: int = 0
    released: threading.Event = field(default_factory=threading.Event)
    holding: threading.Event = field(default_factory=threading.Event)

    def matches(self, method: str, path: str) -> bool:
        return method == self.method and re.search(self.pattern, path) is not None and self.hits < self.count


class FaultyS3:
    def __init__(self):
        self.app = DomainDispatcherApplication(create_backend_app)
        self.rules: list[Rule] = []
        self.requests: list[tuple[str, str, int]] = []  # method, path, status
        self.lock = threading.Lock()
        self.server = make_server("127.0.0.1", 0, self, threaded=True)
        self.port = self.server.port
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        for rule in self.rules:
            rule.released.set()
        self.server.shutdown()
        self.thread.join(timeout=10)

    def reset(self) -> None:
        with self.lock:
            for rule in self.rules:
                rule.released.set()
            self.rules = []
            self.requests = []

    def add(self, method: str, pattern: str, action: str, **kw) -> Rule:
        rule = Rule(method, pattern, action, **kw)
        with self.lock:
            self.rules.append(rule)
        return rule

    def env(self) -> dict:
        """Environment for a client of this server, and of no other: no AWS files, no instance metadata."""
        return {
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_CONFIG_FILE": "/nonexistent",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def __call__(self, environ, start_response):
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        auth = environ.get("HTTP_AUTHORIZATION", "")
        key = re.search(r"Credential=([^/]+)/", auth)
        if key and key[1] != ACCESS_KEY:
            return self._error(start_response, method, path, 403, "InvalidAccessKeyId",
                               "The AWS Access Key Id you provided does not exist in our records.")
        with self.lock:
            rule = next((r for r in self.rules if r.matches(method, path)), None)
            if rule:
                rule.hits += 1
        if rule and rule.action == "delay":
            time.sleep(rule.delay_s)
        elif rule and rule.action == "hold":
            rule.holding.set()
            rule.released.wait(timeout=120)
        elif rule and rule.action == "cut":
            self.requests.append((method, path, 0))
            sock = environ.get("werkzeug.socket")
            sock.shutdown(socket.SHUT_RDWR)
            sock.close()
            return []
        elif rule and rule.action == "error":
            return self._error(start_response, method, path, rule.status, rule.code, "Injected fault")

        def recording_start_response(status, headers, exc_info=None):
            self.requests.append((method, path, int(status.split()[0])))
            return start_response(status, headers, exc_info)

        return self.app(environ, recording_start_response)

    def _error(self, start_response, method, path, status, code, message):
        self.requests.append((method, path, status))
        body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
                f"<RequestId>{time.time_ns()}</RequestId></Error>").encode()
        reason = {403: "Forbidden", 500: "Internal Server Error", 503: "Service Unavailable"}.get(status, "Error")
        start_response(f"{status} {reason}", [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
        return [body]
