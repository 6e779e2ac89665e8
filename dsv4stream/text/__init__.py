"""Tokens in and out: the tokenizer, the chat formats, tool-call markup and the sampler.

`vocab` (what each release's tokenizer holds: V4's and V4.1's control tokens, V4.1's file
made from V4's), `tokenizer` (the checkpoint's tokenizer, packed once; raw encode, chat-prompt
encode where content stays text, decode), `messages` (conversations as data), `chat` (the
entry point: which encoder a checkpoint uses, efforts, render and encode), `chat_v4` and
`chat_v41` (each release's official encoder, rule for rule), `turns` (the turns both encoders
write alike, given each release's tool markup), `dsml` (tool schemas and the
model's calls in each release's tags), `sampler` (logits -> the next id: a ladder of small
pure functions).
"""
