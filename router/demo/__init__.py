"""The demo environment server behind `episode-router demo`
(`python -m router.demo`).
"""

from __future__ import annotations

from router.demo.server import (
    MAX_ADD,
    MAX_SLEEP_S,
    MAX_STREAM_EVENTS,
    MAX_STREAM_INTERVAL_S,
    MCP_PATH,
    MCP_TOOLS,
    MCP_VERSIONS,
    STREAM_TOOL,
    TOKEN_HEADER,
    TOOLS,
    DemoError,
    EpisodeState,
    McpError,
    Notify,
    Tool,
    build_demo_app,
    episode_request,
    main,
    mcp_reply_media,
    mcp_version,
    serve_demo_worker,
    signing_key_from_env,
)

__all__ = [
    "MAX_ADD",
    "MAX_SLEEP_S",
    "MAX_STREAM_EVENTS",
    "MAX_STREAM_INTERVAL_S",
    "MCP_PATH",
    "MCP_TOOLS",
    "MCP_VERSIONS",
    "STREAM_TOOL",
    "TOKEN_HEADER",
    "TOOLS",
    "DemoError",
    "EpisodeState",
    "McpError",
    "Notify",
    "Tool",
    "annotations",
    "build_demo_app",
    "episode_request",
    "main",
    "mcp_reply_media",
    "mcp_version",
    "serve_demo_worker",
    "signing_key_from_env",
]
