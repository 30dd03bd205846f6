"""OpenAI-compatible HTTP front end: create_app(backend, settings), run_server(app, settings)."""

from starshard.server.app import create_app, make_server, run_server
from starshard.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app", "make_server", "run_server"]
