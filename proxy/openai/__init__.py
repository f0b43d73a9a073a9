"""OpenAI's API as the proxy speaks it, shared by the HTTP edge (:mod:`proxy.api`) and
the Batch API (:mod:`proxy.batch`); it imports neither.

- :mod:`proxy.openai.bodies`: request bodies read strictly (JSON rules, typed models
  of the completion and Batch API requests, the published schema's source).
- :mod:`proxy.openai.request`: what a chat or completion request is, once read
  (:class:`~proxy.openai.request.ChatRequest`).
- :mod:`proxy.openai.errors`: OpenAI's error shape and the errors both give.
- :mod:`proxy.openai.answers`: one whole answer as the request path hands it to the
  Batch API (:class:`~proxy.openai.answers.Answer`: its bytes and its object).
- :mod:`proxy.openai.line_ids`: the scheduler's id for a try of a batch line.
"""
