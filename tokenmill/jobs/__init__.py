"""Jobs on the wire (`Job`, `JobResult`) and the producer client. Torch-free."""

from tokenmill.jobs.client import Client, JobFailedError, JobHandle, JobTimeoutError
from tokenmill.jobs.schemas import Job, JobError, JobResult, Usage

__all__ = ["Client", "Job", "JobError", "JobFailedError", "JobHandle", "JobResult", "JobTimeoutError", "Usage"]
