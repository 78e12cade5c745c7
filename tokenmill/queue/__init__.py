"""The wire contract between producers and workers, torch-free: job and result schemas (`schemas`), task,
queue and Redis key names (`names`), queue settings (`settings`), the Celery app as producers need it
(`app`), the Redis transport both sides publish and consume through (`transport`) and dead-letter records
(`dead_letters`). It imports neither side: the client and the worker import it."""
