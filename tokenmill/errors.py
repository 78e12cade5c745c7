"""Errors shared by every layer. Light: no torch, so the client can raise them too."""


class InvalidRequestError(ValueError):
    """A request that can never be served as given. `field` names the offending input."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ModelLoadError(ValueError):
    """The model or its tokenizer cannot be loaded as configured (no such directory, no such hub id offline, a
    checkpoint transformers cannot read): a configuration error, never fixed by trying again."""
