"""Load a checkpoint, start the batching engine and run the API with uvicorn."""

from __future__ import annotations

import ipaddress
import sys
import threading
from pathlib import Path

from lmforge.errors import LMForgeError


def load_engine(checkpoint: str | Path, device: str = "auto", max_batch_size: int = 16, precision: str = "auto",
                background: bool = True, quantize: str = "none", prefill_chunk: int = 512, prefix_cache: int = 4,
                on_step=None):
    """``(engine, tokenizer, model_dir)`` for a gpt-family checkpoint (``quantize``: ``load_for_inference``;
    ``on_step``: the engine's step observer)."""
    from lmforge.infer.engine import Engine
    from lmforge.infer.loading import load_for_inference
    from lmforge.checkpoint import resolve_model_dir

    model, tokenizer, _ = load_for_inference(checkpoint, device, precision, quantize=quantize)
    engine = Engine(model, eos_id=tokenizer.eos_id, max_batch_size=max_batch_size, background=background,
                    prefill_chunk=prefill_chunk, prefix_cache=prefix_cache, on_step=on_step)
    return engine, tokenizer, resolve_model_dir(checkpoint)


def default_model_id(model_dir: Path) -> str:
    """``runs/NAME/checkpoints/step-000100`` -> ``NAME-step-000100``; another directory -> ``PARENT-DIR``."""
    run = model_dir.parent.parent.name if model_dir.parent.name == "checkpoints" else model_dir.parent.name
    return f"{run}-{model_dir.name}" if run else model_dir.name


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_port(host: str, port: int) -> str:
    """``host:port`` as a URL writes it: an IPv6 literal in brackets (``[::1]:8000``)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def serve(checkpoint: str | Path, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          model_id: str | None = None, max_batch_size: int = 16, device: str = "auto", precision: str = "auto",
          log_level: str = "info", quantize: str = "none", prefill_chunk: int = 512, prefix_cache: int = 4,
          trace_steps: str | Path | None = None) -> None:
    """Run the API until interrupted. ``trace_steps``: a file that gets one JSON line per engine step
    (``lmforge.infer.engine.Step``; it is replaced)."""
    if not 0 <= port < 65536:
        raise LMForgeError(f"--port must be in 0..65535, got {port}")
    if max_batch_size < 1:
        raise LMForgeError(f"--max-batch-size must be >= 1, got {max_batch_size}")
    trace = open_trace(trace_steps) if trace_steps else None
    try:
        engine, tokenizer, model_dir = load_engine(checkpoint, device, max_batch_size, precision, background=False,
                                                   quantize=quantize, prefill_chunk=prefill_chunk,
                                                   prefix_cache=prefix_cache,
                                                   on_step=None if trace is None else trace_writer(trace))
        _run(engine, tokenizer, model_dir, host, port, api_key, model_id, max_batch_size, log_level)
    finally:
        if trace is not None:
            trace.close()


def open_trace(path: str | Path):
    path = Path(path)
    if path.is_dir():
        raise LMForgeError(f"--trace-steps {path} is a directory; give a file name, e.g. {path / 'steps.jsonl'}")
    try:
        return path.open("w", buffering=1)  # line-buffered: a trace read while serving is whole lines
    except OSError as e:
        raise LMForgeError(f"cannot write --trace-steps {path}: {e.strerror}") from None


def trace_writer(file):
    """An ``on_step`` that appends each step to ``file`` as a JSON line."""
    import dataclasses
    import json

    def write(step) -> None:
        file.write(json.dumps(dataclasses.asdict(step)) + "\n")
    return write


def _run(engine, tokenizer, model_dir: Path, host: str, port: int, api_key: str | None, model_id: str | None,
         max_batch_size: int, log_level: str) -> None:
    import uvicorn

    from lmforge.serve.app import create_app

    model_id = model_id or default_model_id(model_dir)
    if not is_loopback(host) and not api_key:
        print(f"lmforge serve: warning: listening on {host} without --api-key: anyone who can reach this "
              "machine can use the model", file=sys.stderr)
    dtype = str(next(engine.model.parameters()).dtype).replace("torch.", "")
    if getattr(engine.model, "quantization", None):
        dtype = f"{engine.model.quantization} weights, {dtype} activations,"
    print(f"lmforge serve: model {model_id!r} ({model_dir}), {dtype} on {engine.device}, context {engine.n_ctx} "
          f"tokens, up to {max_batch_size} sequences per batch", file=sys.stderr)
    print(f"lmforge serve: OpenAI API at http://{host_port(host, port)}/v1" + (" (API key required)" if api_key else ""),
          file=sys.stderr, flush=True)
    # The model runs on this (main) thread, the HTTP server on another: PyTorch's CPU kernels ran
    # 10-25% slower on a secondary thread (benchmarks/RESULTS.md), the event loop does not care.
    server = uvicorn.Server(uvicorn.Config(create_app(engine, tokenizer, model_id, api_key), host=host, port=port,
                                           log_level=log_level, timeout_graceful_shutdown=5))
    http = threading.Thread(target=server.run, name="lmforge-http", daemon=True)

    def stop_engine_when_http_ends() -> None:
        http.join()
        engine.close()

    http.start()
    threading.Thread(target=stop_engine_when_http_ends, daemon=True).start()
    try:
        engine.run()
    except KeyboardInterrupt:
        engine.cancel_all()  # open streams end with their finish chunk instead of a reset
    finally:
        server.should_exit = True
        http.join(timeout=10)
    if not server.started:
        raise LMForgeError(f"could not listen on {host_port(host, port)} (is the port in use? pick another with --port)")
