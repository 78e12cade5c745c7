"""The engine: model loading, the ragged runner, sampling, structured outputs and the offline `LLM` API."""

from tokenmill.engine.cpu_threads import limit_spinning

limit_spinning()  # before any engine module imports torch, which loads libgomp
