"""Tokens in and out: the tokenizer, the chat format, tool-call markup and the sampler.

`tokenizer` (the checkpoint's tokenizer, packed once, encode/decode), `chat` (conversations
rendered exactly as DeepSeek's official encoder does), `dsml` (tool schemas and the model's
calls), `sampler` (logits -> the next id: a ladder of small pure functions).
"""
