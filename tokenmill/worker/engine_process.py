"""The engine in its own process (torch only there), driven by its own loop; the worker talks to it over a pipe.

Only the child's loop touches the engine; requests are admitted between two steps and each step's finished outputs
go back in one message. Messages are JSON (`send_bytes`/`recv_bytes`), never pickle:

    worker -> engine   {"op": "add", "id", "prompt" | "messages", "params" (not the defaults), "pooling" (an embedding)
                        | "score" (a score job's continuations), "share" (whose work: a tenant, a run; if any)}
                       | {"op": "add_many", "requests": [add, ...]}
                       | {"op": "abort", "id"} | {"op": "cancel", "id", "reason"} | {"op": "stop"}
    engine -> worker   {"op": "ready", "tokenizer", "max_prompt_chars", "max_model_len"} | {"op": "done", "outputs": [...]}
                       | {"op": "refused", "id", "field", "message"} | {"op": "stats", ...} | {"op": "fatal", "error"}
                       | {"op": "unusable", "error"} (the model cannot be loaded as configured; instead of "ready")

Invariants: neither side blocks on a write while the other cannot read (each side writes through one writer thread,
and no lock is held across a write); a failure of one request ("refused") fails only its job; a failure outside any
request, or the child's death, calls `on_fatal`. See docs/internals/worker.md, section "The engine process".
"""

from __future__ import annotations

import functools
import gc
import logging
import multiprocessing
import os
import queue
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from tokenmill.engine.prompt_limits import check_prompt_chars
from tokenmill.errors import InvalidRequestError, ModelLoadError
from tokenmill.queue import fastjson
from tokenmill.queue.schemas import Embed, Score
from tokenmill.sampling_params import SamplingParams, without_defaults
from tokenmill.worker.output import EngineOutput, output_fields

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

    from tokenmill.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)
#: The worker's log lines, and its engine process's (which logs to the same stderr).
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(process)d]: %(message)s"

_IDLE_WAIT = 0.5  # seconds the engine process blocks on the pipe when it has nothing to run
_STATS_INTERVAL = 0.5


@dataclass
class EngineStatus:
    """What the engine last reported, for the metrics endpoint."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    generated_tokens_per_s: float = 0.0
    new_steps: int = 0


class EngineFailure(RuntimeError):
    """The engine process failed or exited; every request in flight gets this."""


#: What a request ends with: its output, or the error that ends it (`InvalidRequestError`: refused; `EngineFailure`:
#: the engine is gone; `CancelledError`: aborted).
Answer = EngineOutput | Exception
#: Called once per request sent with `send_many`, with its id and its answer: on the reader thread, or on the caller's
#: for a prompt refused before sending and for an abort. It must not block, and must not call back into the engine.
Sink = Callable[[str, Answer], None]
#: One request for the engine: (request id, params: `SamplingParams`, an embedding job's `Embed` or a score job's
#: `Score`, prompt: text or token ids, chat messages, share: whose work it is, for the engine's fair shares, or None).
EngineRequest = tuple[str, SamplingParams | Embed | Score, str | list[int] | None, list[dict[str, str]] | None,
                      str | None]


class EngineProcess:
    """Worker-side handle of the engine process: `submit_many` returns futures of `EngineOutput`s; `send_many` hands
    each answer to a sink instead."""

    def __init__(self, model: str, options: dict[str, Any], on_fatal: Callable[[BaseException], None] | None = None,
                 on_stats: Callable[[EngineStatus], None] | None = None, cpus: set[int] | None = None,
                 on_stall: Callable[[str], None] | None = None, stall_timeout: float | None = None) -> None:
        """`cpus`: the engine process's CPUs (None: anywhere this process may run). `on_stall(why)`: called once, on
        the watchdog thread, after the engine held requests and sent nothing for `stall_timeout` seconds (None: no
        watchdog); the engine process is killed first and no pending request is answered (`abandon`)."""
        # `tokenizers` batches on the calling thread (a thread pool would take cores from the engine, at more CPU)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        context = multiprocessing.get_context("spawn")  # no fork of a process that runs threads
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=serve, args=(child_conn, model, options, cpus, _log_level()), name="tokenmill-engine",
            daemon=True,
        )
        self._child_conn = child_conn
        self._on_fatal = on_fatal
        self._on_stats = on_stats
        self._pending: dict[str, Sink] = {}  # request id -> where its answer goes
        self._lock = threading.Lock()  # guards _pending and _stopping; never held across a pipe write or read
        self._write_lock = threading.Lock()  # registers requests and queues writes in one order; never across a write
        self._outbox = _Outbox(self._conn, "tokenmill-engine-pipe-writer")  # until `stop`, `abandon` or `_lost`
        self._stopping = False
        self._abandoned = False  # see `abandon`
        self._fatal_returned = threading.Event()  # clear while `_lost` calls `on_fatal`: a send waits (`_refuse`)
        self._fatal_returned.set()
        self._on_stall = on_stall
        self._stall_timeout = stall_timeout
        self._heard = time.monotonic()  # when the reader last got a message from the engine
        self._unusable: str | None = None  # why the engine could not load its model, if it could not
        self._died_starting = False  # the engine was lost before "ready": `start` raises, `on_fatal` is not called
        self._ready = threading.Event()
        self._tokenizer: Tokenizer | None = None  # once the engine has sent it
        self._prompt_limits: tuple[int | None, int] = (None, 0)  # (max_prompt_chars, max_model_len)
        self._reader = threading.Thread(target=self._read, name="tokenmill-engine-reader", daemon=True)
        self._last_stats: tuple[float, int, int] | None = None

    def start(self, timeout: float = 600) -> None:
        """Start the process and wait until the model is loaded."""
        self._process.start()
        self._child_conn.close()
        self._reader.start()
        ready = self._ready.wait(timeout)
        if self._unusable is not None:  # the child exits after saying so; `stop` has nothing left to do
            _reap(self._process, 10)
            raise ModelLoadError(self._unusable)
        if self._died_starting:  # the pipe closed before "ready": the child died loading its model
            _reap(self._process, 10)
            raise EngineFailure(f"the engine process died loading its model (exit code {self._process.exitcode})")
        if not ready or not self._process.is_alive():
            raise EngineFailure(f"the engine process did not start (exit code {self._process.exitcode})")
        if self._stall_timeout is not None and self._on_stall is not None:
            threading.Thread(target=self._watch, name="tokenmill-engine-watchdog", daemon=True).start()

    def submit_many(self, requests: list[EngineRequest]) -> list[Future]:
        """`send_many`, each request's answer as a future: its `EngineOutput`, or it raises (`InvalidRequestError`
        when refused); an aborted request's future is cancelled."""
        futures = {request[0]: Future() for request in requests}
        self.send_many(requests, functools.partial(_settle, futures))
        return list(futures.values())

    def send_many(self, requests: list[EngineRequest], sink: Sink, wait: bool = True) -> None:
        """Queue `requests` in one pipe message; each one's answer goes to `sink`. Text prompts go as token ids once
        the engine sent its tokenizer; a prompt refused here is answered at once and not sent.

        `wait`: return once the message is written, and if the write fails raise its error with no request left
        pending. Without it (the consumer's event loop, which must never wait on the pipe) return once queued; a
        failed write then means the engine is gone, and `_lost` answers the requests. Registering and queueing happen
        together under `_write_lock`, so a cancel or abort of one of them is written after it."""
        prompts = self.tokenize([request[2] for request in requests])
        adds = []
        for (request_id, params, _, messages, share), prompt in zip(requests, prompts):
            if isinstance(prompt, InvalidRequestError):
                sink(request_id, prompt)
            else:
                adds.append(_add_op(request_id, params, prompt, messages, share))
        if not adds:
            return
        message = adds[0] if len(adds) == 1 else {"op": "add_many", "requests": adds}
        payload = fastjson.dumps(message, *(add["params"].get("json_schema") for add in adds))
        written = _Written() if wait else None
        with self._write_lock:
            with self._lock:
                stopping = self._stopping
                if not stopping:
                    self._pending.update((add["id"], sink) for add in adds)
            if not stopping:
                self._outbox.put(payload, written)
        if stopping:
            self._refuse()
        if written is not None:
            written.done.wait()  # as long as the write: bounded by the stall watchdog, which kills a frozen engine
            if written.error is not None:
                with self._lock:
                    for add in adds:
                        self._pending.pop(add["id"], None)
                raise written.error

    def tokenize(self, prompts: list[Any]) -> list[Any]:
        """Each text prompt as token ids, or the error refusing it; other prompts (token ids, None) as given."""
        if self._tokenizer is None:
            return prompts
        out: list[Any] = list(prompts)
        texts: dict[int, str] = {}
        for index, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                try:
                    check_prompt_chars(prompt, *self._prompt_limits)
                    texts[index] = prompt
                except InvalidRequestError as exc:
                    out[index] = exc
        if texts:  # in one call, without offsets: far cheaper a prompt than one at a time
            encodings = self._tokenizer.encode_batch_fast(list(texts.values()), add_special_tokens=True)
            for index, encoding in zip(texts, encodings):
                out[index] = encoding.ids
        return out

    def abort(self, request_id: str) -> None:
        """Drop a request (e.g. its job is requeued at shutdown): it is answered with `CancelledError` (its future is
        cancelled) unless it was answered already."""
        with self._write_lock:
            with self._lock:
                sink = self._pending.pop(request_id, None)
                stopping = self._stopping
            if not stopping:
                self._outbox.put(fastjson.dumps({"op": "abort", "id": request_id}))
        if sink is not None:
            sink(request_id, CancelledError())

    def cancel(self, request_id: str, reason: str) -> None:
        """Stop a request at the next step boundary: it is answered with what it generated so far
        (`finish_reason=reason`), or with its normal output if it finished first."""
        with self._write_lock:
            with self._lock:
                live = request_id in self._pending and not self._stopping
            if live:
                self._outbox.put(fastjson.dumps({"op": "cancel", "id": request_id, "reason": reason}))

    def stop(self, timeout: float = 10) -> None:
        """Ask the engine process to exit; kill it if it has not within `timeout` (a frozen one cannot read the ask).
        Also valid after a `start` that raised; for a process never started, only the writer thread ends."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        with self._write_lock:  # after every message a sender queued before it saw `_stopping`
            self._outbox.put(b'{"op": "stop"}')
            self._outbox.end()
        if self._process.pid is None:
            return
        _reap(self._process, timeout)

    def abandon(self) -> None:
        """Kill the engine process and answer no pending request: the caller is exiting and hands their jobs to other
        workers, so an answer now could store a result for a job handed back. A later send waits for that exit."""
        with self._lock:
            self._stopping = self._abandoned = True
            self._pending.clear()
        self._process.kill()  # a write waiting on the full pipe fails now
        with self._write_lock:
            self._outbox.end()
        self._process.join(5)

    def stalled_for(self) -> float:
        """Seconds the engine has held requests without a message; 0 while it has none or keeps reporting."""
        with self._lock:
            held = bool(self._pending) and not self._stopping
        return max(0.0, time.monotonic() - self._heard - _STATS_INTERVAL) if held else 0.0

    def _refuse(self) -> None:
        """A send to a stopped engine raises `EngineFailure`; to an abandoned one it waits for the process's exit
        (bounded by the abandoner), since a failed result would be stored for a job handed back to run elsewhere."""
        if self._abandoned:
            threading.Event().wait()
        self._fatal_returned.wait()  # bounded by `on_fatal` (the worker's exits, under a watchdog): see `_lost`
        raise EngineFailure("the engine is stopped")

    def _watch(self) -> None:
        """The watchdog: `on_stall` once the engine has held requests and been silent for `stall_timeout` seconds."""
        assert self._stall_timeout is not None and self._on_stall is not None
        while not self._stopping:
            time.sleep(min(1.0, self._stall_timeout / 4))
            with self._lock:
                held, silent = len(self._pending), time.monotonic() - self._heard
                stalled = held > 0 and silent > self._stall_timeout and not self._stopping
            if stalled:
                why = (f"the engine process (pid {self._process.pid}) sent nothing for {silent:.0f}s while holding "
                       f"{held} request(s) (stall timeout {self._stall_timeout:g}s): it is frozen, stuck in a step or "
                       "deadlocked")
                self.abandon()
                self._on_stall(why)
                return

    # -- the reader thread ---------------------------------------------------------------------

    def _read(self) -> None:
        while True:
            try:
                message = fastjson.plain_loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                self._lost(EngineFailure(f"the engine process exited (exit code {self._process.exitcode})"))
                return
            self._heard = time.monotonic()
            op = message["op"]
            if op == "done":
                self._resolve({output["request_id"]: EngineOutput(**output) for output in message["outputs"]})
            elif op == "refused":
                self._resolve({message["id"]: InvalidRequestError(message["field"], message["message"])})
            elif op == "stats":
                self._report(message)
            elif op == "ready":
                self._tokenizer = frontend_tokenizer(message["tokenizer"])
                self._prompt_limits = (message["max_prompt_chars"], message["max_model_len"])
                self._ready.set()
            elif op == "fatal":
                self._lost(EngineFailure(f"the engine failed: {message['error']}"))
                return
            elif op == "unusable":  # before "ready": `start` raises it; the child exits, nothing more is written
                with self._lock:
                    self._stopping, self._unusable = True, message["error"]
                with self._write_lock:
                    self._outbox.end()
                self._ready.set()
                return

    def _resolve(self, answers: dict[str, Answer]) -> None:
        """Hand each request's answer to its sink, the sinks taken from the pending ones under one lock for all (a
        step's finished requests come together); a request aborted meanwhile has none."""
        with self._lock:
            sinks = [(self._pending.pop(request_id, None), request_id, answer) for request_id, answer in answers.items()]
        for sink, request_id, answer in sinks:
            if sink is not None:
                sink(request_id, answer)

    def _lost(self, error: EngineFailure) -> None:
        """The engine is gone: `on_fatal` first (the worker's exits), only then fail the requests in flight, so no job
        thread stores a failed result for a job that must run again. Sends meanwhile wait for `on_fatal` (`_refuse`);
        it runs with no lock held, since it logs and logging may block. Before "ready" no request is in flight and
        `start` raises instead: its caller cleans up and decides."""
        with self._lock:
            stopping, self._stopping = self._stopping, True
            pending, self._pending = self._pending, {}
            self._died_starting = not stopping and not self._ready.is_set()
            fatal = not stopping and not self._died_starting
            if fatal:
                self._fatal_returned.clear()
        if fatal:
            try:
                log.critical("%s", error)
                if self._on_fatal is not None:
                    self._on_fatal(error)
            finally:
                self._fatal_returned.set()
        with self._write_lock:  # nothing is queued after this (`_stopping`): the writer ends
            self._outbox.end()
        for request_id, sink in pending.items():
            sink(request_id, error)
        self._ready.set()

    def _report(self, message: dict[str, Any]) -> None:
        now, tokens, steps = time.monotonic(), message["num_generated_tokens"], message["num_steps"]
        before = self._last_stats or (now - _STATS_INTERVAL, tokens, steps)
        self._last_stats = (now, tokens, steps)
        if self._on_stats is not None:
            self._on_stats(EngineStatus(
                num_running=message["num_running"], num_waiting=message["num_waiting"],
                kv_cache_usage=message["kv_cache_usage"],
                generated_tokens_per_s=(tokens - before[1]) / max(now - before[0], 1e-6), new_steps=steps - before[2]))


def _reap(process: multiprocessing.process.BaseProcess, timeout: float) -> None:
    """Wait `timeout` seconds for `process` to exit, then kill it."""
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join(5)


def _add_op(request_id: str, params: SamplingParams | Embed | Score, prompt: str | list[int] | None,
            messages: list[dict[str, str]] | None, share: str | None) -> dict[str, Any]:
    """The engine process's `add` op for one request: an embedding pools (the engine's `PoolingParams`), a score job
    scores its continuations (`add_score_request`), neither samples; any other job samples with `params`."""
    add: dict[str, Any] = {"op": "add", "id": request_id, "prompt": prompt, "messages": messages, "params": {}}
    if share is not None:
        add["share"] = share
    if isinstance(params, Embed):
        add["pooling"] = params.model_dump()
    elif isinstance(params, Score):
        add["score"] = params.continuations
    else:
        add["params"] = without_defaults(params.to_dict())
    return add


def _settle(futures: dict[str, Future], request_id: str, answer: Answer) -> None:
    """`submit_many`'s sink: the request's future takes its answer."""
    future = futures[request_id]
    if future.done():
        return
    if isinstance(answer, CancelledError):
        future.cancel()
    elif isinstance(answer, Exception):
        future.set_exception(answer)
    else:
        future.set_result(answer)


# -- the engine process ------------------------------------------------------------------------


def _log_level() -> int | None:
    """The level the engine process logs at: this process's root level where it configured logging (a spawned process
    starts with none), so that the engine's start-up lines (model implementation, KV cache, graphs) reach its log."""
    root = logging.getLogger()
    return root.level if root.handlers else None


def freeze_startup_objects() -> None:
    """Move every object alive now (modules, the model, the tokenizer) out of the garbage collector's sight: they
    live as long as the process, and a full collection walking them stalls every request in the batch (vLLM and
    SGLang freeze their engine processes' heaps for the same reason)."""
    gc.collect()
    gc.freeze()


def serve(conn: Connection, model: str, options: dict[str, Any], cpus: set[int] | None = None,
          log_level: int | None = None) -> None:
    """Main function of the engine process: load the model once, then step while there is work (on `cpus`, set
    before torch starts a thread). SIGINT and SIGTERM are ignored: sent to the whole process group they must not kill
    the engine under a worker finishing its jobs; the worker ends it with "stop" or by exiting (the pipe closes).
    `log_level`: the starting process's (`_log_level`), None to leave logging unconfigured as it was there."""
    if log_level is not None:
        logging.basicConfig(level=log_level, format=LOG_FORMAT, stream=sys.stderr)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if cpus:
        os.sched_setaffinity(0, cpus)
    from tokenmill.engine.llm_engine import LLMEngine  # torch is imported here, in this process only

    outbox = _Outbox(conn)
    try:
        engine = LLMEngine(model, **options)
    except ModelLoadError as exc:  # a configuration error: the worker reports it and does not ask for a restart
        outbox.send({"op": "unusable", "error": str(exc)})
        outbox.close(timeout=10)
        return
    loop = _Loop(engine, conn, outbox)
    freeze_startup_objects()
    outbox.send({"op": "ready", "tokenizer": tokenizer_for_frontend(engine.tokenizer),
                 "max_prompt_chars": loop.max_prompt_chars, "max_model_len": engine.max_model_len})
    try:
        loop.run()
    except (EOFError, OSError):  # the worker process is gone: nothing left to serve
        return
    except BaseException as exc:
        try:
            outbox.send({"op": "fatal", "error": repr(exc)})
            outbox.close(timeout=10)  # the worker learns why before this process exits
        finally:
            raise


class _Written:
    """A `send_many` waiting on its write: `done` once written or failed (then `error`)."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None


class _Outbox:
    """One side's messages on the pipe, written in order by a thread of their own, so no sender waits on a full pipe
    (the engine's loop never does; a `send_many` that asks waits on its `_Written`). A failed write goes to its waiting
    sender, if any; the writer goes on, so later writes fail fast too, and the other side's end shows on the next
    read: the engine's loop sees the pipe closed, the worker's reader reports the engine lost (`_lost`)."""

    def __init__(self, conn: Connection, name: str = "tokenmill-engine-writer") -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue[tuple[bytes, _Written | None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name=name, daemon=True)
        self._thread.start()

    def put(self, payload: bytes, written: _Written | None = None) -> None:
        self._queue.put((payload, written))

    def send(self, message: dict[str, Any], *free: Any) -> None:
        """`free`: the parts of `message` that may hold any JSON value (see `fastjson.dumps`)."""
        self.put(fastjson.dumps(message, *free, default=_plain))

    def end(self) -> None:
        """No more messages: the writer ends once it wrote those queued."""
        self._queue.put(None)

    def close(self, timeout: float) -> None:
        """Write what was sent, waiting at most `timeout` seconds."""
        self.end()
        self._thread.join(timeout)

    def _write(self) -> None:
        while (item := self._queue.get()) is not None:
            payload, written = item
            try:
                self._conn.send_bytes(payload)
            except BaseException as exc:  # noqa: BLE001 (the writer goes on for the writes queued after it)
                if written is not None:
                    written.error = exc
            finally:
                if written is not None:
                    written.done.set()


class _Loop:
    def __init__(self, engine: LLMEngine, conn: Connection, outbox: _Outbox) -> None:
        self.engine = engine
        self.conn = conn
        self.outbox = outbox
        # asked before every step whether a message came: `Connection.poll` builds a selector for each call, several
        # times the cost of one `poll` object kept, and a lone job pays it on every decode step
        self._incoming = select.poll()
        self._incoming.register(conn.fileno(), select.POLLIN)
        self.live: set[str] = set()
        self.next_stats = 0.0
        self.max_prompt_chars = engine.max_prompt_chars

    def run(self) -> None:
        while True:
            if not self._admit(wait=0.0 if self.engine.has_unfinished() else _IDLE_WAIT):
                return
            if self.engine.has_unfinished():
                self._step()
            self._maybe_stats()

    def _admit(self, wait: float) -> bool:
        """Handle every message that arrived (waiting up to `wait` for the first); False on stop."""
        if not self._incoming.poll(1000 * wait):
            return True
        while True:
            message = fastjson.plain_loads(self.conn.recv_bytes())
            if message["op"] == "stop":
                return False
            self._handle(message)
            if not self._incoming.poll(0):
                return True

    def _handle(self, message: dict[str, Any]) -> None:
        if message["op"] == "add_many":
            for add in message["requests"]:
                self._handle(add)
            return
        request_id = message["id"]
        if message["op"] == "abort":
            if request_id in self.live:
                self.live.discard(request_id)
                self.engine.abort_request(request_id)
            return
        if message["op"] == "cancel":  # a request that finished in the meantime was answered already
            if request_id in self.live:
                self.live.discard(request_id)
                output = self.engine.cancel_request(request_id, message["reason"])
                if output is not None:
                    self._send_done([output])
            return
        try:
            params = SamplingParams.from_dict(message["params"])  # a text prompt's length: checked by `add_request`
            share = message.get("share")
            prompt = message["prompt"] if message["messages"] is None else self.engine.apply_chat_template(message["messages"])
            if "pooling" in message:  # an embedding
                from tokenmill.engine.pooling import PoolingParams

                self.engine.add_request(request_id, prompt, pooling=PoolingParams(**message["pooling"]), share=share)
            elif "score" in message:  # a score job
                self.engine.add_score_request(request_id, prompt, message["score"], share=share)
            else:
                self.engine.add_request(request_id, prompt, params, share=share)
        except InvalidRequestError as exc:
            self.outbox.send({"op": "refused", "id": request_id, "field": exc.field, "message": exc.message})
            return
        except Exception as exc:  # e.g. the chat template cannot render these messages: this request only
            field = "prompt" if message["messages"] is None else "messages"
            self.outbox.send({"op": "refused", "id": request_id, "field": field, "message": f"{type(exc).__name__}: {exc}"})
            return
        self.live.add(request_id)

    def _step(self) -> None:
        """One engine step. A request that failed on its own in it is refused; only its job fails."""
        outputs = self.engine.step()
        if not outputs:
            return
        for output in outputs:
            self.live.discard(output.request_id)
            if output.finish_reason == "error":
                field, _, text = (output.error or "request: failed").partition(": ")
                self.outbox.send({"op": "refused", "id": output.request_id, "field": field, "message": text})
        done = [o for o in outputs if o.finish_reason != "error"]
        if done:
            self._send_done(done)

    def _send_done(self, outputs: list[Any]) -> None:
        """Finished requests in one message; their logprobs, parsed output and choice probabilities (keyed by the
        request's own choices) may hold any JSON value."""
        free = [part for output in outputs
                for part in (output.logprobs, output.parsed, output.choice_probabilities, output.embedding)]
        self.outbox.send({"op": "done", "outputs": [output_fields(output) for output in outputs]}, *free)

    def _maybe_stats(self) -> None:
        now = time.monotonic()
        if now < self.next_stats:
            return
        self.next_stats = now + _STATS_INTERVAL
        stats = self.engine.stats()
        self.outbox.send({
            "op": "stats",
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "kv_cache_usage": stats.kv_cache_usage,
            "num_generated_tokens": stats.num_generated_tokens,
            "num_steps": getattr(stats, "num_steps", 0),
        })


#: Texts the front-end tokenizer must encode exactly as the engine's tokenizer before it is used.
_TOKENIZER_PROBES = ("Hello, world!", " leading and trailing spaces ", "tabs\tand\nnewlines\r\n", "UNICODE: é ß 中文 🙂 \u200b",
                     "digits 1234567890 and symbols {\"a\": [1, 2.5e-3]} <|x|>", "a" * 300)


def tokenizer_for_frontend(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The tokenizer as `tokenizers` JSON for the worker to encode prompts with, or None where the worker
    could not encode exactly as `tokenizer.encode(text, add_special_tokens=True)` does here: a tokenizer
    without a `tokenizers` backend, or one whose probe texts (and special tokens written as text) encode
    differently, or one set to split special tokens written as text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "split_special_tokens", False):
        return None
    spec = backend.to_str()
    rebuilt = frontend_tokenizer(spec)
    probes = [*_TOKENIZER_PROBES, " ".join(str(t) for t in getattr(tokenizer, "all_special_tokens", []))]
    for text in probes:
        if rebuilt.encode(text, add_special_tokens=True).ids != tokenizer.encode(text, add_special_tokens=True):
            log.warning("the tokenizer encodes %r differently through `tokenizers` alone: prompts are tokenized in "
                        "the engine process", text[:40])
            return None
    return spec


def frontend_tokenizer(spec: str | None) -> Tokenizer | None:
    """A `tokenizers.Tokenizer` from its JSON, set up as transformers encodes (no truncation, no padding,
    special tokens written as text matched as special tokens)."""
    if spec is None:
        return None
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(spec)
    tokenizer.no_truncation()
    tokenizer.no_padding()
    tokenizer.encode_special_tokens = False
    return tokenizer


def _plain(value: Any) -> Any:
    """JSON for what the engine may put in logprobs (tensors, numpy scalars)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    return str(value)
