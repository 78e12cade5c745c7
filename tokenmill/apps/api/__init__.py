"""`tokenmill serve`: the OpenAI Files and Batches API (and `POST /v1/embeddings`) in front of the queue.

`app` (FastAPI routes), `settings` (`ServeSettings`), `auth` (bearer keys -> tenants), `records` (file and
batch records in Redis), `files` (file contents in a directory or S3), `driver` (one thread per batch that is
not final: validate, queue, collect, write the output files), `embeddings` (`POST /v1/embeddings` over the
queue), `webhooks` (signed batch events from a Redis
outbox), `server` (the command, uvicorn).
"""
