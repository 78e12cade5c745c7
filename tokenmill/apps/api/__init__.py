"""`tokenmill serve`: the OpenAI Files and Batches API in front of the queue.

`app` (FastAPI routes), `settings` (`ServeSettings`), `auth` (bearer keys -> tenants), `records` (file and
batch records in Redis), `files` (file contents on local disk), `driver` (one thread per batch that is not
final: validate, queue, collect, write the output files), `server` (the command, uvicorn).
"""
