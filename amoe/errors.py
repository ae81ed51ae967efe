"""The error hierarchy: every failure a user can cause or see is an AmoeError subclass."""


class AmoeError(Exception):
    """Base of every error amoe raises on purpose."""


class ConfigError(AmoeError):
    """A configuration value or combination is invalid."""


class ModelLoadError(AmoeError):
    """A model directory, file or tensor cannot be used."""


class UnsupportedTokenizerError(ModelLoadError):
    """A tokenizer a feature cannot use: its decoder gives tokens no bytes of their own, which a grammar needs."""


class TransportError(AmoeError):
    """A message or tensor could not be moved between runtimes."""


class EngineDeadError(AmoeError):
    """A runtime or engine thread stopped and cannot serve further requests."""


class RequestError(AmoeError):
    """A request is malformed or cannot be served (bad prompt, bad sampling parameters); `param` names the
    request field at fault when there is one (the API reports it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestFailed(AmoeError):
    """The engine failed while serving one request; that request fails alone (a server error, not the client's)."""
