"""An OpenAI-compatible multi-turn server that keeps each conversation's Raincheck cache.

``python -m raincheck_hf serve`` (needs the ``serve`` extra: FastAPI + uvicorn). A follow-up that
resends the dialogue continues the held conversation whose token ids are its longest prefix
(images and videos compared by content hash), so it prefills only its own new tokens; between
requests the model's restorer thread restores the held conversations' deferred tokens in idle time. See
``docs/serving.md``.

Layout: `schema` (the request as pydantic models: validation and ``/docs``), `protocol` (the request
checked against the server: model, vocabulary, limits), `media` (images and videos: sized from their
headers, decoded under the limits), `store` (held conversations: matching, eviction), `admission`
(running places and the queue), `app` (the routes, streaming, cancellation, the request log), `metrics`
(Prometheus, through prometheus_client), `cli` (the command).
"""

from .app import ServeSettings, Server, create_app, running
from .protocol import APIError, Limits, parse_chat_request
from .store import ConversationStore, ServedConversation, cache_nbytes

__all__ = ["APIError", "ConversationStore", "Limits", "ServeSettings", "ServedConversation", "Server", "cache_nbytes",
           "create_app", "parse_chat_request", "running"]
