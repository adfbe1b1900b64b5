"""episode-router: routes each episode's requests to the worker process that holds it."""

__version__ = "0.1.0"
