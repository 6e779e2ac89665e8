"""`dsv4 serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine.

Data flow: HTTP request -> `schemas` (validated fields) -> `prompt` (token ids in the V4
chat format) -> `worker` (the engine thread: prefix reuse through `cache`, generation) ->
`reply` (text, reasoning, tool calls per token) -> `openai` / `anthropic` / `responses`
(each API's shapes and SSE, over `toolkit`), assembled into one FastAPI app by `app`.
"""
