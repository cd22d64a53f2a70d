"""Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens), served by
the chat completions' machinery: a request becomes the chat completion it asks for, and
the answer (whole or streamed) Anthropic's message and events."""
