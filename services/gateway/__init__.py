"""The OpenAI-compatible HTTP gateway: validates requests, fans them into the mesh, and streams
the mesh's text deltas back as OpenAI responses or SSE chunks."""

from services.gateway.app import GatewayServer, build_app, serve
from services.gateway.config import GatewayConfig, parse_args

__all__ = ["GatewayConfig", "GatewayServer", "build_app", "parse_args", "serve"]
