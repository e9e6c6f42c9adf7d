"""The reward model service: one process holding a Hugging Face sequence classifier, scoring
(prompt, response) pairs for every client that posts them, in batches.

    python -m rl_engine.rewards.reward_model_server '{"path": "runs/models/rm", "batch_size": 16, ...}'

It binds an ephemeral port on the settings' `host` (taskset.reward.host, default 127.0.0.1:
loopback keeps it on one machine; anyone who reaches it can make it compute), loads the model,
prints `listening <port>` on stdout (the one line it ever writes there; its logs go to stderr)
and serves until SIGTERM, or until the process that started it is gone (`RFT_ENGINE_OWNER_PID`, rl_engine.proc.owner_watch), so it never outlives its run.

    POST /score  {"pairs": [[prompt, response], ...]}
              -> {"scores": [float, ...], "batch_sizes": [int, ...], "compute_ms": float}
    GET  /health -> {"ok": true, "pid": int, "path": str}

JSON only. Requests from concurrent clients (the explorers of a run) wait in one queue; a single
scoring thread takes as many whole requests as fit in `batch_size` pairs and scores them as one
padded batch (a request of more pairs than that is scored alone, `batch_size` at a time), so
the model runs one batch at a time and small requests of several explorers share a forward
pass. `batch_sizes` are the sizes of the batches a request's pairs were scored in.

A pair is rendered with the tokenizer's chat template when it has one (user = prompt, assistant =
response), else as prompt + response, and cut to its last `max_length` tokens (a reward model
reads its score at the last token, which the cut must keep). The score is the classifier's one
logit there, in float32.

Test-only knob: RFT_REWARD_SERVICE_DELAY_S=<seconds> makes every batch wait that long before it is
scored (tests/rl_engine/rewards/test_reward_model.py uses it for timeouts); unset in any real run.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

DELAY_ENV = "RFT_REWARD_SERVICE_DELAY_S"
_MAX_BODY = 256 * 1024 * 1024  # a step's pairs as JSON; more is a client bug, not a batch


def format_pair(tokenizer: Any, prompt: str, response: str) -> tuple[str, bool]:
    """(text, whether it is already templated) of one pair: the chat template's rendering of
    user = prompt, assistant = response when the tokenizer has a template, else prompt + response."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        return tokenizer.apply_chat_template(messages, tokenize=False), True
    return prompt + response, False


def load_scorer(path: str, device: str = "cpu", dtype: str = "float32") -> tuple[Any, Any]:
    """(model, tokenizer) of a sequence-classification directory, ready to score: eval mode, a pad
    token (a batch needs one; the classifier reads each row's score at its last non-pad token)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.truncation_side = "left"  # keep the response's end: the score is read at the last token
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=getattr(torch, dtype))
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model.to(device).eval(), tokenizer


def score_pairs(model: Any, tokenizer: Any, pairs: list[tuple[str, str]], max_length: int) -> list[float]:
    """The classifier's score of each (prompt, response) pair, in order, as one padded batch."""
    import torch

    texts = [format_pair(tokenizer, p, r) for p, r in pairs]
    templated = texts[0][1] if texts else False  # one tokenizer: all templated or none
    enc = tokenizer(
        [t for t, _ in texts],
        padding=True,
        truncation=True,
        max_length=max_length,
        add_special_tokens=not templated,  # a template writes its own special tokens
        return_tensors="pt",
    )  # input_ids, attention_mask: [B, L]
    with torch.inference_mode():
        logits = model(**{k: v.to(model.device) for k, v in enc.items()}).logits  # [B, 1]
    return logits[:, 0].float().tolist()


class _Request:
    def __init__(self, pairs: list[tuple[str, str]]):
        self.pairs = pairs
        self.scores: list[float] = []
        self.batch_sizes: list[int] = []
        self.error: str | None = None
        self.done = threading.Event()


class Batcher:
    """The scoring thread: whole queued requests packed into batches of at most `batch_size` pairs."""

    def __init__(self, model: Any, tokenizer: Any, batch_size: int, max_length: int):
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.max_length = batch_size, max_length
        self.queue: queue.Queue[_Request] = queue.Queue()
        self.delay_s = float(os.environ.get(DELAY_ENV) or 0.0)
        threading.Thread(target=self._loop, name="reward-model-batcher", daemon=True).start()

    def submit(self, pairs: list[tuple[str, str]], timeout_s: float) -> _Request:
        req = _Request(pairs)
        self.queue.put(req)
        req.done.wait(timeout_s)  # the client gives up at its own timeout; this only frees the thread
        return req

    def _loop(self) -> None:
        held: _Request | None = None
        while True:
            first = held or self.queue.get()
            held, group, n = None, [first], len(first.pairs)
            while n < self.batch_size:
                try:
                    nxt = self.queue.get_nowait()
                except queue.Empty:
                    break
                if n + len(nxt.pairs) > self.batch_size:
                    held = nxt  # the next batch's first
                    break
                group.append(nxt)
                n += len(nxt.pairs)
            self._run(group)

    def _run(self, group: list[_Request]) -> None:
        pairs = [p for r in group for p in r.pairs]
        try:
            scores: list[float] = []
            sizes: list[int] = []
            for i in range(0, len(pairs), self.batch_size):
                chunk = pairs[i : i + self.batch_size]
                if self.delay_s:
                    time.sleep(self.delay_s)  # the test-only knob of the module docstring
                scores += score_pairs(self.model, self.tokenizer, chunk, self.max_length)
                sizes.append(len(chunk))
        except Exception as e:  # noqa: BLE001 - reported to each waiting client, the service goes on
            for r in group:
                r.error = f"{type(e).__name__}: {e}"
                r.done.set()
            return
        at = 0
        for r in group:
            r.scores = scores[at : at + len(r.pairs)]
            r.batch_sizes = sizes if len(group) == 1 else [len(pairs)]
            at += len(r.pairs)
            r.done.set()


def _handler(batcher: Batcher, path: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: Any) -> None:  # one line per request is noise
            pass

        def _reply(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._reply(200, {"ok": True, "pid": os.getpid(), "path": path})
            else:
                self._reply(404, {"error": f"no such endpoint {self.path}"})

        def do_POST(self) -> None:
            if self.path != "/score":
                self._reply(404, {"error": f"no such endpoint {self.path}"})
                return
            try:
                size = int(self.headers.get("Content-Length") or 0)
                if size > _MAX_BODY:
                    raise ValueError(f"request of {size} bytes; send at most {_MAX_BODY}")
                body = json.loads(self.rfile.read(size))
                pairs = [(str(p), str(r)) for p, r in body["pairs"]]
            except Exception as e:  # noqa: BLE001 - a malformed request is the client's, answered
                self._reply(400, {"error": f"bad request: {type(e).__name__}: {e}"})
                return
            started = time.monotonic()
            req = batcher.submit(pairs, float(body.get("timeout_s") or 3600.0))
            if not req.done.is_set():
                self._reply(504, {"error": "not scored within the request's timeout"})
            elif req.error is not None:
                self._reply(500, {"error": req.error})
            else:
                ms = 1000 * (time.monotonic() - started)
                self._reply(200, {"scores": req.scores, "batch_sizes": req.batch_sizes, "compute_ms": ms})

    return Handler


def main(argv: list[str]) -> None:
    from rl_engine.proc.owner_watch import start_owner_watch

    start_owner_watch()  # exits with its owner: no orphan when the run's process is killed
    args = json.loads(argv[0])
    model, tokenizer = load_scorer(args["path"], args.get("device", "cpu"), args.get("dtype", "float32"))
    batcher = Batcher(model, tokenizer, int(args["batch_size"]), int(args["max_length"]))
    server = ThreadingHTTPServer((args.get("host", "127.0.0.1"), 0), _handler(batcher, args["path"]))
    server.daemon_threads = True
    print(f"listening {server.server_address[1]}", flush=True)
    sys.stdout.close()
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
