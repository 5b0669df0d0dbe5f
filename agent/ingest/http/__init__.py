"""Ferry's HTTP front door: Hermes-style publishing, topic management and the status probes.

- ``app.py``: ``create_app()``, the one ASGI app of the listener. A thin raw-ASGI path
  serves ``POST /topics/{topic}`` and ``POST /topics/{topic}/batch``; everything else goes to
  a Starlette app (management, ``/status/ping|health|ready``, ``/openapi.json`` and the status
  engineer's routes).
- ``server.py``: ``HttpServer``, Ferry's protocol on uvloop in its own thread, with the
  connection cap; ``protocol.py`` the protocol itself (httptools' public parser, every limit
  of the exchange, publishes handed whole to ``Publisher.publish`` without ASGI);
  ``asgi.py`` runs the other routes on the Starlette app.
- ``auth.py``: the management token and the cross-site refusal.
- ``topics.py``: ``TopicCatalog``, topic settings from the config file and the management API.
- ``publish.py``: the publish handler; ``codecs.py`` validates and converts bodies;
  ``delivery.py`` waits for Kafka's acknowledgement (201 vs 202); ``idempotency.py`` and
  ``ratelimit.py`` hold what their names say; ``management.py`` the topic API.

docs/http.md is the API reference.
"""
