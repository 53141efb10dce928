"""OpenAI-compatible HTTP server over the engine core (``chunklocal serve MODEL``).

``app.py`` (routes), ``protocol.py`` (request / response bodies), ``params.py`` (sampling
arguments and limits), ``prompts.py`` (tokenization, chat template), ``generate.py``
(requests in flight), ``responses.py`` (bodies and stream chunks), ``metrics.py``
(Prometheus), ``cli.py`` (flags, uvicorn, signals).  Importing this package imports none
of the web packages.
"""
